"""The gated-delta-net families under parallelism: what runs and what is refused.

FSDP2 layouts split them over data-parallel ranks (HSDP included); tensor parallelism,
Ulysses / context parallelism and packed rows are refused with the reason, on every
path (layouts, ``check_strategy``, the advisor's rules). Megatron layouts hold them
(Megatron-Core's ``GatedDeltaNet``) but for context parallelism, a ``tp`` that does not
divide the linear key heads, and the Transformer-Engine naming. The
refusal of packed rows rests on a fact of transformers' modules pinned here: a
linear-attention layer does not restart its state where ``position_ids`` restart, so a
packed row's second sequence sees the first (full attention alone would not).
"""

import json

import pytest
import torch

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.linear_attention import check_packing
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.engines import ulysses
from tests.distributed import gated_delta_configs

FAMILIES = {
    "qwen3_next": gated_delta_configs.qwen3_next(),
    "qwen3_5_text": gated_delta_configs.qwen3_5_text(),
    "qwen3_5_moe_text": gated_delta_configs.qwen3_5_moe_text(),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fsdp2_data_parallel_layouts_and_refusals(name: str) -> None:
    spec = model_from_hf_config(FAMILIES[name])
    for ok in ("fsdp:d4", "fsdp:d2"):
        assert fsdp2_layout(spec, ok).world_size == int(ok[-1])
    with pytest.raises(
        LayoutError, match=rf"tp=2: {name}'s linear-attention layers split their fused projections"
    ):
        fsdp2_layout(spec, "fsdp:d2t2")
    with pytest.raises(
        LayoutError,
        match=rf"cp=2: {name}'s linear-attention layers carry a recurrent state along the sequence",
    ):
        fsdp2_layout(spec, "fsdp:d2c2")
    assert megatron_layout(spec, "megatron:d2t2").world_size == 4
    with pytest.raises(
        LayoutError,
        match=rf"^cp=2: Megatron-Core 0.16's GatedDeltaNet has no context parallelism \({name}'s",
    ):
        megatron_layout(spec, "megatron:d2c2")
    with pytest.raises(
        LayoutError,
        match=rf"^tp=4 does not divide linear_num_key_heads=2 \({name}\); Megatron-Core's "
        r"GatedDeltaNet gives every TP rank whole key heads and their value heads; use tp in "
        r"\{1, 2\}$",
    ):
        # four KV heads, so that tp=4 breaks the linear key heads alone
        four_kv = model_from_hf_config({**FAMILIES[name], "num_key_value_heads": 4})
        megatron_layout(four_kv, "megatron:t4")
    with pytest.raises(LayoutError, match=rf"^naming='te' for {name}: the Transformer-Engine"):
        megatron_layout(spec, "megatron:d4", naming="te")
    with pytest.raises(
        LayoutError, match=rf"packed sequences are refused: {name}'s linear-attention layers"
    ):
        check_packing(spec)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_inference_tp_splits_full_attention_and_keeps_linear_attention_whole(name: str) -> None:
    """Inference layouts under TP: gated q_proj by heads (``[q_h; gate_h]`` rows stay
    together), every linear-attention tensor whole on every rank."""
    spec = model_from_hf_config(FAMILIES[name])
    layout = inference_layout(spec, "sglang:d1t2")
    for rank in (0, 1):
        local = {lt.name: lt for lt in layout.local_tensors(rank)}
        q = local["model.layers.1.self_attn.q_proj.weight"]
        full = spec.tensor("model.layers.1.self_attn.q_proj.weight").shape
        assert q.shape == (full[0] // 2, full[1])
        (piece,) = q.pieces
        assert piece.canonical_box.ranges[0] == (rank * full[0] // 2, (rank + 1) * full[0] // 2)
        for t in spec.layer_tensors(0):
            if ".linear_attn." in t.name:
                assert local[t.name].shape == t.shape


def test_other_families_pack() -> None:
    cfg = {k: v for k, v in FAMILIES["qwen3_5_text"].items() if k != "layer_types"}
    check_packing(model_from_hf_config({**cfg, "model_type": "qwen3"}))


def test_transformers_linear_attention_does_not_reset_at_packed_boundaries() -> None:
    """Two sequences packed in one row (position_ids restarting at 0) against each run
    alone: the second one's logits move in transformers' Qwen3.5 (its linear-attention
    state and conv carry over the boundary); with every layer full attention (and the
    engines' attention function, whose mask follows ``position_ids``) they agree."""
    transformers = pytest.importorskip("transformers")
    outs = {}
    for kinds in (None, ["full_attention"] * 4):
        cfg = dict(FAMILIES["qwen3_5_text"])
        if kinds:
            cfg["layer_types"] = kinds
        spec = model_from_hf_config(cfg)
        rest = {k: v for k, v in spec.hf_config().items() if k != "model_type"}
        config = transformers.AutoConfig.for_model(spec.model_type, **rest)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        ulysses.install(model, None)  # the engines' attention: a causal mask per sequence
        a, b = torch.arange(1, 7), torch.arange(20, 29)
        with torch.no_grad():
            alone = model(input_ids=b[None]).logits[0]
            packed = model(
                input_ids=torch.cat([a, b])[None],
                position_ids=torch.cat([torch.arange(6), torch.arange(9)])[None],
            ).logits[0, 6:]
        outs["full" if kinds else "hybrid"] = float((alone - packed).abs().max())
    assert outs["full"] < 1e-5, outs
    assert outs["hybrid"] > 1e-3, outs


def test_linear_layers_cost_no_sequence_squared_term_and_cache_no_tokens() -> None:
    """Per token, a linear-attention layer's FLOPs do not grow with the sequence (a full
    attention layer's do), and its cache does not grow with the context."""
    from areal_fn.pipeline.costs import flop_costs
    from areal_fn.plans.memory.kv_cache import kv_cache

    spec = model_from_hf_config(FAMILIES["qwen3_5_text"])  # layer 1 full, the others linear
    per_token = [flop_costs(spec, seq_len=s).layers for s in (64, 4096)]
    assert per_token[0][0] / 64 == per_token[1][0] / 4096
    assert per_token[0][1] / 64 < per_token[1][1] / 4096
    short, long = (kv_cache(spec, "sglang:d1", context_len=n) for n in (64, 4096))
    assert long.max_bytes - short.max_bytes == (4096 - 64) * long.bytes_per_token_layer
    assert short.stage_linear == (3,) and short.linear_state_elements > 0
    with pytest.raises(SpecError, match=r"kv_cache: tp=4 does not divide linear_num_key_heads=2"):
        kv_cache(spec, "sglang:d1t4", context_len=64)


def test_plan_on_the_published_configs(capsys: pytest.CaptureFixture[str]) -> None:
    """``areal-fn plan`` on Qwen3-Next-80B-A3B: the inference component's cache holds 12
    full-attention layers of tokens and 36 linear-attention states (each 32 value heads
    of 128 x 128 plus 3 conv inputs of 2 * 16 * 128 + 32 * 128 channels, split 4 ways);
    Megatron layouts held (context parallelism refused), Ulysses refused, with the reason."""
    from areal_fn.cli import main

    assert main(["plan", "Qwen3-Next-80B-A3B-Instruct", "fsdp:d8+sglang:d1t4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["num_params"] == 79_674_391_296
    kv = doc["components"][1]["kv_cache"]
    assert kv["stage_linear_layers"] == [36] and kv["stage_layers"] == [48]
    assert kv["linear_state_elements"] == (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) // 4
    full = 12 * kv["context_len"] * 2 * (2 // 2) * 256 * 2  # K and V, 1 KV head a rank, bf16
    assert kv["max_bytes"] == full + 36 * kv["linear_state_elements"] * 2
    assert main(["plan", "Qwen3-Next-80B-A3B-Instruct", "megatron:d4t2"]) == 0
    capsys.readouterr()
    for alloc, why in (("megatron:d4c2", "GatedDeltaNet has no context"), ("fsdp:d4c2", "cp=2")):
        assert main(["plan", "Qwen3-Next-80B-A3B-Instruct", alloc]) == 2
        assert why in capsys.readouterr().err
