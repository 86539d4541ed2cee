"""The layouts of an FP8 deployment (:mod:`areal_fn.plans.fp8_sync`): each rank holding a
piece of a quantised weight holds it in ``float8_e4m3fn`` and the scales of the blocks
the piece touches; the bound of a sync between two such layouts counts one byte per
quantised value and four per scale a destination rank holds (counted here from the
inference layout's pieces by hand), and the planner meets it."""

import math

import pytest

from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.model.quantized import Fp8Format
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.fp8_sync import fp8_layout, fp8_quantization
from areal_fn.plans.transfer import plan_transfers
from areal_fn.plans.transfer.bound import transfer_lower_bound
from areal_fn.strategy.allocation import ParallelDims

SPEC = model_from_hf_config(
    {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 320,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 72,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    return any(name.endswith(f".{m}.weight") for m in LINEARS)


@pytest.mark.parametrize("block", [(16, 16), (128, 128), (24, 40)])
def test_destination_ranks_hold_fp8_pieces_and_their_blocks_scales(block: tuple[int, int]) -> None:
    infer = inference_layout(SPEC, ParallelDims(tp=2), vocab_multiple=1)
    infer8 = fp8_layout(infer, Fp8Format(block=block))
    expected_bytes = 0
    for r in range(2):
        plain = {lt.name: lt for lt in infer.local_tensors(r)}
        held = {lt.name: lt for lt in infer8.local_tensors(r)}
        scales = {n for n in held if n.endswith(".weight_scale_inv")}
        assert scales == {n + "_scale_inv" for n in plain if is_linear(n)}
        for name, lt in plain.items():
            (piece,) = lt.pieces
            if not is_linear(name):
                assert held[name].dtype == lt.dtype == "bfloat16"
                expected_bytes += 2 * math.prod(lt.shape)
                continue
            assert held[name].dtype == "float8_e4m3fn"
            box = piece.canonical_box
            assert box is not None
            grid = tuple(
                (lo // b, math.ceil(hi / b)) for (lo, hi), b in zip(box.ranges, block, strict=True)
            )
            (scale,) = held[name + "_scale_inv"].pieces
            assert scale.canonical == name + "_scale_inv"
            assert scale.canonical_box is not None and scale.canonical_box.ranges == grid
            assert held[name + "_scale_inv"].dtype == "float32"
            expected_bytes += math.prod(lt.shape) + 4 * math.prod(hi - lo for lo, hi in grid)
    train8 = fp8_layout(fsdp2_layout(SPEC, ParallelDims(dp=2)), Fp8Format(block=block))
    ranks = {"src_ranks": (0, 1), "dst_ranks": (2, 3)}
    assert transfer_lower_bound(train8, infer8, **ranks) == expected_bytes
    assert plan_transfers(train8, infer8, **ranks).bytes_total == expected_bytes


def test_cut_blocks_are_shared_by_the_ranks_whose_pieces_cut_them() -> None:
    quant = {
        q.name: q for q in fp8_quantization(fsdp2_layout(SPEC, ParallelDims(dp=2)), Fp8Format())
    }
    assert set(quant) == {c.name for c in SPEC.tensors if is_linear(c.name)}
    # gate_proj [320, 64]: fsdp halves of 160 rows cut block row 1 (rows 128..256)
    gate = quant["model.layers.0.mlp.gate_proj.weight"]
    assert gate.plan.cut_blocks == ((1, 0),)
    assert gate.slots == (0, 1)
    assert [p[1].ranges if p else None for p in gate.pieces] == [
        ((0, 160), (0, 64)),
        ((160, 320), (0, 64)),
    ]
