"""Laws of the declarative HF <-> Megatron family tables.

A family's Megatron correspondence is its table of ``MegatronTensor`` records; one
generic function interprets it. Checked here: the table's conditions are ModelSpec
flags, the interpreted layout round-trips canonical tensors for every family, and a
family that is only a different table (no code) gets its own layout that round-trips.
"""

import contextlib

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.errors import LayoutError
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.families import FAMILIES, family
from areal_fn.model.families.mapping import (
    CONDITIONS,
    Fusion,
    LayerKind,
    MegatronTensor,
)
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import to_hf, to_megatron
from areal_fn.sharding.placement import Shard
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.rules import check_dims
from areal_fn.testing.models import MEGATRON_FAMILY_NAMES, model_specs


def _canonical(model: ModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}


def _round_trip(model: ModelSpec, dims: ParallelDims) -> None:
    layout = megatron_layout(model, dims)
    canon = _canonical(model)
    states = {r: to_megatron(canon, layout, r) for r in range(layout.world_size)}
    back = to_hf(states, layout, check_replicas=True)
    assert back.keys() == canon.keys()
    for name, t in canon.items():
        assert torch.equal(back[name], t), name


def test_conditions_are_boolean_or_count_model_spec_fields():
    flags = {f.name for f in attrs.fields(ModelSpec) if f.type in (bool, int)}
    derived = {c for c in CONDITIONS if isinstance(getattr(ModelSpec, c, None), property)}
    assert derived == {"q_direct"}
    assert set(CONDITIONS) <= flags | derived


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_record_condition_and_layer_kind_is_known(name):
    for rec in FAMILIES[name].megatron:
        assert rec.when is None or rec.when in CONDITIONS
        assert isinstance(rec.layers, LayerKind)
        assert isinstance(rec.fusion, Fusion)


@settings(max_examples=25)
@given(
    st.sampled_from(MEGATRON_FAMILY_NAMES).flatmap(lambda f: model_specs(f)),
    st.sampled_from([1, 2]),
)
def test_each_family_table_round_trips_at_tp(model, tp):
    try:
        check_dims(model, "megatron", ParallelDims(tp=tp))
    except LayoutError:
        tp = 1  # the drawn model does not divide by 2 (a rule tested elsewhere)
    _round_trip(model, ParallelDims(tp=tp))


def _unfused(rec: MegatronTensor) -> tuple[MegatronTensor, ...]:
    """QKV as three separate row-sharded parameters: a family that only differs by its table."""
    if rec.fusion is not Fusion.QKV:
        return (rec,)
    base = rec.local.replace("linear_qkv", "linear_{}")
    return tuple(
        MegatronTensor(local=base.format(part), hf=hf, tp=Shard(dim=0), when=rec.when)
        for part, hf in zip("qkv", rec.hf, strict=True)
    )


@contextlib.contextmanager
def _qwen2_with_unfused_qkv():  # type: ignore[no-untyped-def]
    qwen2 = FAMILIES["qwen2"]
    table = tuple(r for rec in qwen2.megatron for r in _unfused(rec))
    FAMILIES["qwen2"] = attrs.evolve(qwen2, megatron=table)
    try:
        yield
    finally:
        FAMILIES["qwen2"] = qwen2
    assert family("qwen2") is qwen2


@settings(max_examples=10)
@given(model=model_specs("qwen2"))
def test_a_new_table_is_a_new_family(model):
    with _qwen2_with_unfused_qkv():
        names = {t.name for t in megatron_layout(model, ParallelDims()).tensors}
        assert "decoder.layers.0.self_attention.linear_q.weight" in names
        assert "decoder.layers.0.self_attention.linear_qkv.weight" not in names
        _round_trip(model, ParallelDims())
    names = {t.name for t in megatron_layout(model, ParallelDims()).tensors}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in names
