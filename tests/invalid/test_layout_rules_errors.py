"""Every layout function and check refuses the degrees it cannot express, by one rule.

One table of (call, message regex): the layout functions called with ``ParallelDims``
directly (no ``Component`` to refuse a degree first), ``check_strategy`` on allocation
strings, and the remedies, which list only values that pass every rule.
"""

import functools
import pathlib

import pytest

from areal_fn.cli import main
from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.advisor.census import fsdp2_census, megatron_census
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.check import check_strategy
from areal_fn.strategy.parse import parse_allocation

SPECS = pathlib.Path(__file__).resolve().parents[2] / "specs" / "models"


@functools.cache
def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


def strategy(name: str, alloc: str):  # type: ignore[no-untyped-def]
    return lambda: check_strategy(spec(name), parse_allocation(alloc))


Q7 = "Qwen2.5-7B"

CASES = [
    # D3: degrees a layout cannot express are refused, not ignored
    (
        "fsdp2 pipeline",
        lambda: fsdp2_layout(spec(Q7), ParallelDims(pp=2)),
        r"^pp=2: an FSDP2 layout has no pipeline stages \(every rank holds a shard of every "
        r"layer\); use pp=1, or megatron for pipeline parallelism$",
    ),
    (
        "fsdp2 experts",
        lambda: fsdp2_layout(spec("Qwen3-30B-A3B"), ParallelDims(dp=2, ep=2)),
        r"^ep=2: an FSDP2 layout does not split experts across ranks \(FSDP2 shards the stacked "
        r"experts like any other parameter\); use ep=1, or megatron for expert parallelism$",
    ),
    (
        "fsdp2 expert tensor parallel",
        lambda: fsdp2_layout(spec("Qwen3-30B-A3B"), ParallelDims(dp=2, etp=2)),
        r"^etp=2: an FSDP2 layout does not shard experts over tensor parallel ranks \(its TP "
        r"leaves experts replicated\); use etp=1, or megatron for expert tensor parallelism$",
    ),
    (
        "fsdp2 census pipeline",
        lambda: fsdp2_census(spec(Q7), ParallelDims(pp=2)),
        r"^pp=2: an FSDP2 layout has no pipeline stages",
    ),
    (
        "inference expert tensor parallel",
        lambda: inference_layout(spec(Q7), ParallelDims(dp=2, etp=2)),
        r"^etp=2: an inference layout takes d, t, p only \(the engines shard experts by their "
        r"own options\); use etp=1$",
    ),
    (
        "inference context parallel",
        lambda: inference_layout(spec(Q7), ParallelDims(cp=2)),
        r"^cp=2: an inference layout takes d, t, p only; use cp=1$",
    ),
    (
        "megatron census of a dense model with experts",
        lambda: megatron_census(spec(Q7), ParallelDims(dp=2, ep=2)),
        r"^ep=2 given for dense model qwen2 without experts; use ep=1 \(expert "
        r"parallelism splits experts only\)$",
    ),
    # D4: fsdp's c is checked by the one rule everywhere (layouts, census, check_strategy)
    (
        "fsdp2 layout c3 on 28 heads",
        lambda: fsdp2_layout(spec(Q7), ParallelDims(cp=3)),
        r"^cp=3 does not divide num_attention_heads=28 / tp=1 = 28 heads per TP rank \(qwen2\); "
        r"fsdp's c is Ulysses sequence parallelism, whose attention all-to-all splits those "
        r"heads cp ways; use cp in \{1, 2, 4, 28\}$",
    ),
    (
        "check_strategy fsdp:c3",
        strategy(Q7, "fsdp:c3"),
        r"^fsdp \(fsdp:d1c3\) cannot hold this qwen2 model: cp=3 does not divide "
        r"num_attention_heads=28 / tp=1 = 28 heads per TP rank \(qwen2\)",
    ),
    (
        "check_strategy fsdp:t2c4: 14 heads per TP rank",
        strategy(Q7, "fsdp:t2c4"),
        r"cp=4 does not divide num_attention_heads=28 / tp=2 = 14 heads per TP rank \(qwen2\);"
        r".*; use cp in \{1, 2, 14\}$",
    ),
    (
        "fsdp KV heads and cp do not divide one another",
        strategy(Q7, "fsdp:c7"),
        r"cp=7 and num_key_value_heads=4 / tp=1 = 4 KV heads per TP rank \(qwen2\) do not "
        r"divide one another; Ulysses splits KV heads cp ways, repeating them when cp is a "
        r"multiple; use cp in \{1, 2, 4, 28\}$",
    ),
    # D5: remedies list only values that pass every rule
    (
        "megatron t8: heads, then KV heads",
        strategy(Q7, "megatron:t8"),
        r"tp=8 does not divide num_attention_heads=28 \(qwen2\); tensor parallelism shards "
        r"whole attention heads; use tp in \{1, 2, 4\}$",
    ),
    (
        "megatron t7",
        strategy(Q7, "megatron:t7"),
        r"tp=7 does not divide num_key_value_heads=4 \(qwen2\); Megatron shards whole query "
        r"groups; use tp in \{1, 2, 4\}$",
    ),
    (
        "sglang t14: replication needs a multiple of the KV heads",
        strategy(Q7, "sglang:t14"),
        r"tp=14 exceeds num_key_value_heads=4 but is not a multiple of it; the engines "
        r"replicate each KV head on tp/kv ranks; use tp in \{1, 2, 4\}$",
    ),
    (
        "sglang t28: KV replication fine, channels not",
        strategy(Q7, "sglang:t28"),
        r"tp=28 does not divide intermediate_size=18944 \(qwen2\); TP shards whole MLP "
        r"channels; use tp in \{1, 2, 4\}$",
    ),
    (
        "experts: the remedy keeps the expert folding",
        strategy("Qwen3-30B-A3B", "megatron:d3e3"),
        r"ep=3 does not divide num_experts=128 \(qwen3_moe\); every expert-parallel rank holds "
        r"whole experts; use ep in \{1\}$",
    ),
    (
        "experts on 8 ranks",
        strategy("Qwen3-30B-A3B", "megatron:d6e6"),
        r"ep=6 does not divide num_experts=128 \(qwen3_moe\).*; use ep in \{1, 2\}$",
    ),
    (
        "pipeline chunks exceed layers",
        strategy("Qwen2.5-0.5B", "megatron:d1p25"),
        r"pp=25 x vpp=1 = 25 pipeline chunks exceed num_layers=24; every chunk needs at least "
        r"one layer; use pp in \{1, 2, \.\.\., 24\}$",
    ),
    (
        "virtual stages exceed layers",
        strategy("Qwen2.5-0.5B", "megatron:d1p12v3"),
        r"pp=12 x vpp=3 = 36 pipeline chunks exceed num_layers=24; every chunk needs at least "
        r"one layer; use vpp in \{1, 2\}$",
    ),
    (
        "inference stages exceed layers",
        strategy("Qwen2.5-0.5B", "vllm:p25"),
        r"pp=25 exceeds num_layers=24; every pipeline stage needs at least one layer; use pp "
        r"in \{1, 2, \.\.\., 24\}$",
    ),
    # D10: what SGLang's own model code cannot hold (sglang 0.5.23); vLLM holds it
    (
        "sglang: tied Llama on two stages",
        strategy("Llama-3.2-1B", "sglang:p2"),
        r"^sglang \(sglang:d1p2\) cannot hold this llama model: SGLang's LlamaForCausalLM cannot "
        r"serve a model with tie_word_embeddings at pp=2: it uses model.embed_tokens as lm_head, "
        r"and embed_tokens exists on the first pipeline rank only \(sglang/srt/models/llama.py\); "
        r"use pp=1, vllm, or an untied model$",
    ),
    (
        "sglang: the pipeline remedy for a tied Llama",
        strategy("Llama-3.2-1B", "sglang:p17"),
        r"pp=17 exceeds num_layers=16; every pipeline stage needs at least one layer; use pp in "
        r"\{1\}$",
    ),
    (
        "sglang: tied Qwen3-MoE",
        lambda: check_strategy(
            model_from_hf_config(
                dict(
                    model_type="qwen3_moe",
                    hidden_size=16,
                    intermediate_size=16,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    head_dim=8,
                    vocab_size=64,
                    num_experts=2,
                    num_experts_per_tok=1,
                    moe_intermediate_size=8,
                    tie_word_embeddings=True,
                )
            ),
            parse_allocation("sglang:d2"),
        ),
        r"SGLang's Qwen3MoeForCausalLM cannot serve a model with tie_word_embeddings: it builds its "
        r"own lm_head and never loads the tied embedding into it "
        r"\(sglang/srt/models/qwen3_moe.py\); use vllm or an untied model$",
    ),
    (
        "inference padded vocabulary",
        lambda: inference_layout(
            model_from_hf_config(
                dict(
                    model_type="qwen2",
                    hidden_size=24,
                    intermediate_size=24,
                    num_hidden_layers=1,
                    num_attention_heads=3,
                    num_key_value_heads=3,
                    vocab_size=64,
                )
            ),
            ParallelDims(tp=3),
        ),
        r"tp=3 does not divide the padded vocabulary 64 \(vocab_size=64 padded to a multiple of "
        r"64\); the engines split the padded vocabulary evenly; use tp in \{1\}$",
    ),
]


@pytest.mark.parametrize(("what", "call", "message"), CASES, ids=[c[0] for c in CASES])
def test_layouts_and_checks_refuse_by_one_rule(what, call, message):
    with pytest.raises(LayoutError, match=message):
        call()


def test_vllm_serves_a_tied_llama_on_two_stages():
    check_strategy(spec("Llama-3.2-1B"), parse_allocation("vllm:p2+fsdp:d2"))


def test_plan_refuses_fsdp_c3_on_28_heads(capsys):
    assert main(["plan", "Qwen2.5-7B", "fsdp:c3"]) == 2
    err = capsys.readouterr().err
    assert "cp=3 does not divide num_attention_heads=28 / tp=1 = 28 heads per TP rank" in err
    assert "use cp in {1, 2, 4, 28}" in err


def test_plan_suggests_only_tp_values_that_pass(capsys):
    assert main(["plan", "Qwen2.5-7B", "megatron:t8"]) == 2
    err = capsys.readouterr().err
    assert "use tp in {1, 2, 4}" in err and "7" not in err.split("use tp in")[1]
