"""The strategy advisor on the published configs: the usual guidance, and its own laws.

Guidance (80 GiB devices, bf16 weights, fp32 grads/master/Adam, 4k-token micro-batches
with recompute): small dense models on 8 devices -> FSDP first; 70B+ dense models ->
tensor and/or pipeline parallelism; MoE models -> expert parallelism at the top.
Laws: every suggestion fits and parses back, suggestions are sorted by score, the
result is deterministic, and the search stays fast for the largest model.
"""

import functools
from pathlib import Path

import pytest

from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.advisor import Suggestion, suggest_strategy
from areal_fn.plans.memory import GIB, ActivationModel, PrecisionPolicy, estimate_memory
from areal_fn.strategy.allocation import Backend
from areal_fn.strategy.parse import parse_allocation
from tools.golden import layout_for

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
GB80 = 80 * GIB


@functools.cache
def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


@functools.cache
def advise(name: str, n: int, margin: float = 0.1) -> tuple[Suggestion, ...]:
    return suggest_strategy(spec(name), n, GB80, top=5, memory_margin=margin)


@pytest.mark.parametrize(
    "name", ["Qwen2.5-0.5B", "Llama-3.2-1B", "Qwen2.5-7B", "Llama-3.1-8B", "Qwen3-8B"]
)
def test_small_dense_models_on_8_devices_get_fsdp_first(name):
    best = advise(name, 8)[0]
    assert best.backend is Backend.FSDP, best.why
    assert best.allocation == "fsdp:d8"
    assert "FSDP" in best.why and "free" in best.why


@pytest.mark.parametrize(
    ("name", "n", "margin"),
    [
        ("Llama-3.1-70B", 16, 0.0),
        ("Llama-3.1-70B", 64, 0.1),
        ("Qwen2.5-72B", 64, 0.1),
        ("Llama-3.1-405B", 128, 0.1),
    ],
)
def test_big_dense_models_get_tensor_or_pipeline_parallelism(name, n, margin):
    for s in advise(name, n, margin)[:3]:
        assert s.dims.tp > 1 or s.dims.pp > 1, s.why
        assert ("TP" in s.why) or ("bubble" in s.why)


@pytest.mark.parametrize(
    ("name", "n"),
    [("Qwen3-30B-A3B", 8), ("Qwen3-30B-A3B", 16), ("Qwen3-30B-A3B", 64), ("Qwen3-235B-A22B", 64)],
)
def test_moe_models_get_expert_parallelism_at_the_top(name, n):
    top = advise(name, n)
    assert top[0].dims.ep > 1, top[0].why
    assert "e" in top[0].allocation.split(":")[1] and "EP" in top[0].why
    assert sum(s.dims.ep > 1 for s in top[:3]) >= 2


@pytest.mark.parametrize(
    ("name", "n"), [("Qwen2.5-7B", 8), ("Llama-3.1-70B", 64), ("Qwen3-30B-A3B", 16)]
)
def test_suggestions_fit_parse_back_and_are_sorted(name, n):
    out = advise(name, n)
    assert 1 <= len(out) <= 5
    assert [s.score for s in out] == sorted(s.score for s in out)
    for s in out:
        assert s.memory.max_total <= 0.9 * GB80
        assert s.memory.world_size == n and len(s.memory.rows) == n
        comp = parse_allocation(s.allocation).components[0]
        assert comp.dims == s.dims and comp.backend is s.backend
        assert s.score == pytest.approx(s.comm.step_seconds)
        assert s.comm.compute_seconds > 0 and s.comm.bubble_seconds >= 0
        assert s.why.startswith(s.allocation + ": peak ") and str(s) == s.why


def test_backends_restrict_the_search():
    out = suggest_strategy(spec("Qwen2.5-7B"), 8, GB80, backends=("megatron",), top=3)
    assert all(s.backend is Backend.MEGATRON for s in out)
    assert suggest_strategy(spec("Qwen2.5-7B"), 8, GB80, backends="fsdp", top=1)[0].dims.dp == 8


@pytest.mark.parametrize(("name", "n"), [("Qwen2.5-7B", 8), ("Qwen3-30B-A3B", 16)])
def test_suggested_memory_equals_the_report_of_the_real_layout(name, n):
    model = spec(name)
    checked = 0
    for s in advise(name, n)[:2]:
        if model.num_layers % (s.dims.pp * s.dims.vpp):
            continue  # the advisor split unevenly; layout_for uses Megatron's even split
        component = parse_allocation(s.allocation).components[0]
        checked += 1
        report = estimate_memory(
            layout_for(model, component),
            PrecisionPolicy.bf16_mixed(),
            activation=ActivationModel(micro_batch_size=1, seq_len=4096, recompute=True),
            model=model,
            dims=s.dims,
        )
        assert report == s.memory
    assert checked


def test_advice_is_deterministic():
    a = suggest_strategy(spec("Qwen3-30B-A3B"), 16, GB80, top=4)
    b = suggest_strategy(spec("Qwen3-30B-A3B"), 16, GB80, top=4)
    assert a == b and [s.why for s in a] == [s.why for s in b]


def test_the_largest_moe_model_on_256_devices_gets_expert_parallelism():
    # (how long advice takes is a benchmark's figure, not a test's: python -m bench memory)
    out = suggest_strategy(spec("Qwen3-235B-A22B"), 256, GB80, top=3)
    assert out[0].dims.ep > 1 and out[0].dims.world_size == 256
