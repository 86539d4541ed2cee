"""check_strategy refuses what cannot run, naming the model, the numbers and the remedy."""

import pathlib

import pytest

from areal_fn.errors import LayoutError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.strategy.check import check_strategy
from areal_fn.strategy.parse import parse_allocation

SPECS = pathlib.Path(__file__).resolve().parents[2] / "specs" / "models"


def model(name: str):
    return model_from_hf_config(SPECS / f"{name}.json")


CASES = [
    (
        "Qwen2.5-7B",
        "megatron:d1t8",
        None,
        r"megatron \(megatron:d1t8\) cannot hold this qwen2 model: tp=8 does not divide num_attention_heads=28 \(qwen2\); tensor parallelism shards whole attention heads; use tp in \{1, 2, 4\}$",
    ),
    (
        "Qwen2.5-7B",
        "megatron:d1t7",
        None,
        r"tp=7 does not divide num_key_value_heads=4 \(qwen2\); Megatron shards whole query groups; use tp in \{1, 2, 4\}$",
    ),
    ("Qwen2.5-7B", "fsdp:d1t7", None, r"tp=7 does not divide num_key_value_heads=4"),
    (
        "Qwen2.5-7B",
        "sglang:d1t14",
        None,
        r"tp=14 exceeds num_key_value_heads=4 but is not a multiple of it; the engines replicate each KV head on tp/kv ranks",
    ),
    (
        "Qwen3-30B-A3B",
        "megatron:d3e3",
        None,
        r"ep=3 does not divide num_experts=128 \(qwen3_moe\); every expert-parallel rank holds whole experts; use ep in \{1\}$",
    ),
    (
        "Qwen2.5-0.5B",
        "megatron:d1p25",
        None,
        r"pp=25 x vpp=1 = 25 pipeline chunks exceed num_layers=24",
    ),
    (
        "Qwen2.5-0.5B",
        "megatron:d1p12v3",
        None,
        r"pp=12 x vpp=3 = 36 pipeline chunks exceed num_layers=24",
    ),
    (
        "Qwen2.5-7B",
        "megatron:d2e2",
        None,
        r"ep=2 given for dense model qwen2 without experts; use ep=1",
    ),
    (
        "Qwen2.5-7B",
        "fsdp:d4",
        8,
        r"allocation fsdp:d4 needs 4 ranks but 8 devices were given; change the degrees so their product is 8",
    ),
    ("Qwen2.5-7B", "sglang:d4t2+fsdp:d8", 8, r"needs 16 ranks but 8 devices were given"),
]


@pytest.mark.parametrize(
    ("name", "alloc", "devices", "message"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_check_strategy_refuses(name, alloc, devices, message):
    with pytest.raises(LayoutError, match=message):
        check_strategy(model(name), parse_allocation(alloc), n_devices=devices)


@pytest.mark.parametrize(
    ("name", "alloc"),
    [
        (
            "Qwen2.5-7B",
            "sglang:d1t8",
        ),  # 28 heads: t8 does not divide -> refused above for megatron; sglang too
    ],
)
def test_inference_tp_must_divide_query_heads(name, alloc):
    with pytest.raises(LayoutError, match=r"tp=8 does not divide num_attention_heads=28"):
        check_strategy(model(name), parse_allocation(alloc))


@pytest.mark.parametrize(
    ("name", "alloc"),
    [
        ("Qwen2.5-7B", "sglang:d2t4+megatron:d2p2t2"),
        ("Qwen3-8B", "sglang:d1t16+fsdp:d16"),  # 8 KV heads replicated twice
        ("Qwen3-235B-A22B", "sglang:d8t8+megatron:(attn:d4p8t2|ffn:e8)"),
        ("Llama-3.1-405B", "vllm:d2t16+megatron:d8p8t8"),
    ],
)
def test_check_strategy_accepts_real_jobs(name, alloc):
    check_strategy(model(name), parse_allocation(alloc))


def test_fsdp2_refuses_uneven_tp_rows_over_more_than_two_shards():
    from areal_fn import Fsdp2Options, ParallelDims, fsdp2_layout, model_from_hf_config

    m = model_from_hf_config(
        dict(
            model_type="qwen2",
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=9,
        )
    )
    with pytest.raises(
        LayoutError,
        match=r"model.embed_tokens.weight: dim 0 of size 9 is not divisible by tp=2, and FSDP2 over dp_shard=4 \(> 2\)",
    ):
        fsdp2_layout(m, ParallelDims(dp=4, tp=2))
    fsdp2_layout(m, ParallelDims(dp=4, tp=2), options=Fsdp2Options(tp_embeddings=False))


def test_fsdp2_refuses_uneven_shared_expert_rows_before_the_layout():
    """The shared experts' width that tp does not divide, over more than two FSDP shards:
    ``check_strategy`` (what ``plan`` runs) refuses it as the layout does, in one message."""
    from areal_fn import ParallelDims, fsdp2_layout, model_from_hf_config
    from tests.laws.test_mtp import TINY  # the one tiny DeepSeek-V3 config

    m = model_from_hf_config({**TINY, "moe_intermediate_size": 3})  # one shared expert
    message = (
        r"model.layers.1.mlp.shared_experts.gate_proj.weight: dim 0 of size 3 is not divisible "
        r"by tp=2, and FSDP2 over dp_shard=4 \(> 2\) then stores shards its own placements "
        r"\(StridedShard\) do not describe; use a tp that divides the shared experts' width 3 "
        r"\(deepseek_v3\) or keep dp_shard = dp\*cp <= 2"
    )
    with pytest.raises(LayoutError, match=message):
        check_strategy(m, parse_allocation("fsdp:d4t2"))
    with pytest.raises(LayoutError, match=r"shared_experts.gate_proj.weight: dim 0 of size 3"):
        fsdp2_layout(m, ParallelDims(dp=4, tp=2))
    check_strategy(m, parse_allocation("fsdp:d2t2"))  # two shards: FSDP2 stores them evenly
    fsdp2_layout(m, ParallelDims(dp=2, tp=2))
