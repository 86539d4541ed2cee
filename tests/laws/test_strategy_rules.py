"""Laws of the one parallel-degree rule: every path agrees, and every remedy works.

- A remedy (``use tp in {1, 2, 4}``) lists only values that pass: put any of them in
  place of the refused degree (the other degrees left as they were valid) and the
  strategy is accepted.
- ``check_strategy``, the layout functions, the censuses and the advisor accept and
  refuse the same degrees, with the same message.
"""

import functools
import itertools
import re
from pathlib import Path

import attrs
import pytest

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.advisor import suggest_strategy
from areal_fn.plans.advisor.census import fsdp2_census, megatron_census
from areal_fn.plans.memory import GIB, ActivationModel
from areal_fn.strategy.allocation import Backend, Component, ParallelDims
from areal_fn.strategy.check import check_component, check_strategy

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
ALL = sorted(p.stem for p in SPECS.glob("*.json"))
SMALL = ["Qwen2.5-0.5B", "Llama-3.2-1B", "Qwen2.5-7B", "Qwen3-8B"]
REMEDY = re.compile(r"use (\w+) in \{([^}]*)\}$")


@functools.cache
def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


def remedy(message: str) -> tuple[str, list[int]] | None:
    """The field and values of a message's ``use F in {...}`` remedy (``a, b, ..., z`` is a run)."""
    m = REMEDY.search(message)
    if m is None:
        assert not re.search(r"use \w+ in [\[{]", message), f"unparsable remedy: {message}"
        return None
    items = [s.strip() for s in m.group(2).split(",")]
    if "..." in items:
        i = items.index("...")
        lo, hi = int(items[i - 1]), int(items[i + 1])
        values = (
            [int(s) for s in items[:i]] + list(range(lo + 1, hi)) + [int(s) for s in items[i + 1 :]]
        )
    else:
        values = [int(s) for s in items]
    return m.group(1), values


def outcome(model: ModelSpec, backend: Backend, dims: ParallelDims) -> str | None:
    try:
        check_component(model, Component(backend=backend, dims=dims))
    except LayoutError as e:
        return str(e).split(": ", 1)[1]  # without the "fsdp (fsdp:d1t3) cannot hold..." prefix
    return None


def one_degree(backend: Backend, model: ModelSpec, field: str, value: int) -> ParallelDims | None:
    """Every degree 1 but ``field`` (dp fills what expert folding needs)."""
    kw = {field: value}
    if field in ("ep", "etp"):
        kw["dp"] = value
    if field == "vpp":
        kw["pp"] = 2
    try:
        dims = ParallelDims(**kw)
        Component(backend=backend, dims=dims)
    except SpecError:
        return None
    return dims


FIELDS = {
    Backend.FSDP: ("tp", "cp"),
    Backend.MEGATRON: ("tp", "pp", "ep", "etp", "vpp"),
    Backend.SGLANG: ("tp", "pp"),
}
VALUES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 14, 16, 28, 32, 48, 64, 100, 128)


@pytest.mark.parametrize("name", ALL)
def test_every_value_a_remedy_lists_is_accepted(name):
    model = spec(name)
    refused = 0
    for backend, fields in FIELDS.items():
        for field, value in itertools.product(fields, VALUES):
            dims = one_degree(backend, model, field, value)
            if dims is None:
                continue
            message = outcome(model, backend, dims)
            if message is None:
                continue
            refused += 1
            found = remedy(message)
            if found is None:
                continue
            f, values = found
            assert f == field and value not in values, message
            for v in values:
                fixed = attrs.evolve(dims, **{f: v})
                assert outcome(model, backend, fixed) is None, (message, v)
    assert refused


def test_remedies_hold_with_the_other_degrees_fixed():
    """tp and cp together (fsdp's Ulysses rule reads both), pp with vpp."""
    model = spec("Qwen2.5-7B")
    for backend, tp, cp in itertools.product(
        (Backend.FSDP, Backend.MEGATRON), (1, 2, 4, 7), (1, 2, 3, 4, 7)
    ):
        dims = ParallelDims(tp=tp, cp=cp)
        message = outcome(model, backend, dims)
        found = remedy(message) if message else None
        if found is None:
            continue
        f, values = found
        for v in values:
            assert outcome(model, backend, attrs.evolve(dims, **{f: v})) is None, (message, v)


def _call(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except LayoutError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", SMALL)
def test_check_strategy_layouts_and_censuses_agree(name):
    model = spec(name)
    grid = [
        ParallelDims(tp=tp, cp=cp, pp=pp)
        for tp, cp, pp in itertools.product((1, 2, 3, 4, 7, 8), (1, 2, 3), (1, 2, 30))
    ]
    for dims in grid:
        megatron = outcome(model, Backend.MEGATRON, dims)
        if megatron is not None or model.num_layers % dims.pp == 0:  # Megatron's even split
            assert _call(lambda d=dims: megatron_census(model, d)) == megatron
            assert _call(lambda d=dims: megatron_layout(model, d)) == megatron
        fsdp = _call(lambda d=dims: fsdp2_layout(model, d))
        assert _call(lambda d=dims: fsdp2_census(model, d)) == fsdp
        heads = model.num_attention_heads
        if dims.pp > 1 or (heads % dims.tp == 0 and heads // dims.tp % dims.cp):
            assert fsdp is not None, dims  # no stages to hold; Ulysses' heads rule for c
        if dims.pp == 1:
            assert outcome(model, Backend.FSDP, dims) == fsdp
        inference = _call(lambda d=dims: inference_layout(model, d))
        if dims.cp == 1:
            assert outcome(model, Backend.VLLM, dims) == inference
            sglang = outcome(model, Backend.SGLANG, dims)  # plus what SGLang's models cannot hold
            if model.tie_word_embeddings and model.model_type in ("llama", "qwen3_moe"):
                assert inference is None or sglang is not None
                assert sglang is None or inference is not None or sglang.startswith("SGLang's")
            else:
                assert sglang == inference


@pytest.mark.parametrize(
    ("name", "n", "seq_len"),
    [
        ("Qwen2.5-7B", 8, 4096),
        ("Qwen2.5-7B", 64, 4096),
        ("Qwen3-8B", 16, 32768),
        ("Qwen2.5-7B", 8, 32768),
    ],
)
def test_the_advisor_suggests_only_what_check_strategy_accepts(name, n, seq_len):
    model = spec(name)
    act = ActivationModel(micro_batch_size=1, seq_len=seq_len, recompute=True)
    out = suggest_strategy(model, n, 80 * GIB, top=20, activation=act)
    for s in out:
        assert outcome(model, s.backend, s.dims) is None, s.allocation
        # rows of seq_len tokens split as the engine splits them under c (both backends)
        check_strategy(model, s.allocation, seq_len=seq_len)
        assert s.dims.cp == 1 or seq_len // s.dims.cp >= 4096, s.allocation
    if seq_len >= 32768:  # long rows: both backends' c among the suggestions
        assert {s.backend for s in out if s.dims.cp > 1} == {Backend.FSDP, Backend.MEGATRON}
