"""Bad family tables and layout kinds are refused with the record, the rule and the remedy."""

import contextlib
import re

import attrs
import pytest

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.families import FAMILIES
from areal_fn.model.families.mapping import CONDITIONS, Fusion, LayerKind, MegatronTensor
from areal_fn.model.spec import model_from_hf_config
from areal_fn.sharding.placement import Replicate, Shard
from areal_fn.strategy.allocation import ParallelDims

TINY = {
    "model_type": "qwen2",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
}


@contextlib.contextmanager
def _table(records):  # type: ignore[no-untyped-def]
    qwen2 = FAMILIES["qwen2"]
    FAMILIES["qwen2"] = attrs.evolve(qwen2, megatron=records)
    try:
        yield
    finally:
        FAMILIES["qwen2"] = qwen2


def _layout_with(records):  # type: ignore[no-untyped-def]
    def call():  # type: ignore[no-untyped-def]
        with _table(records(FAMILIES["qwen2"].megatron)):
            megatron_layout(model_from_hf_config(TINY), ParallelDims())

    return call


CASES = [
    (
        "fusion with the wrong number of sources",
        lambda: MegatronTensor(local="a.weight", hf=("x", "y"), tp=Replicate()),
        SpecError,
        r"^MegatronTensor 'a\.weight': fusion Fusion\.WHOLE takes 1 canonical tensors, "
        r"got hf=\('x', 'y'\)$",
    ),
    (
        "condition that is not a flag",
        lambda: MegatronTensor(local="a.weight", hf="x", tp=Replicate(), when="bias"),
        SpecError,
        # every table condition (CONDITIONS), in its order
        r"when='bias' is not a ModelSpec flag; use one of "
        + re.escape(repr(CONDITIONS))
        + r" or None$",
    ),
    (
        "expert record without {e}",
        lambda: MegatronTensor(
            local="e.{local}.w",
            grouped="w{local}",
            hf="mlp.experts.0.down_proj.weight",
            tp=Replicate(),
            expert=True,
            layers=LayerKind.MOE,
        ),
        SpecError,
        r"expert=True but hf=\('mlp\.experts\.0\.down_proj\.weight',\); an expert record "
        r"names every source with '\{e\}', others name none$",
    ),
    (
        "expert record without {local}",
        lambda: MegatronTensor(
            local="e.w",
            hf="mlp.experts.{e}.down_proj.weight",
            tp=Replicate(),
            expert=True,
            layers=LayerKind.MOE,
        ),
        SpecError,
        r"an expert record needs '\{local\}' in local and in grouped \(got grouped=None\)$",
    ),
    (
        "expert record on dense layers",
        lambda: MegatronTensor(
            local="e.{local}.w",
            grouped="w{local}",
            hf="mlp.experts.{e}.down_proj.weight",
            tp=Replicate(),
            expert=True,
        ),
        SpecError,
        r"expert records belong to MoE layers$",
    ),
    (
        "table listing a parameter twice",
        lambda: attrs.evolve(
            FAMILIES["qwen2"],
            megatron=(
                *FAMILIES["qwen2"].megatron,
                MegatronTensor(
                    local="mlp.linear_fc2.weight", hf="mlp.down_proj.weight", tp=Shard(dim=1)
                ),
            ),
        ),
        SpecError,
        r"^family 'qwen2': its Megatron table lists 'mlp\.linear_fc2\.weight' twice for the "
        r"same layers \(LayerKind\.DENSE and LayerKind\.ALL\)$",
    ),
    (
        "table that misses a canonical tensor",
        _layout_with(
            lambda t: tuple(r for r in t if r.local != "self_attention.linear_proj.weight")
        ),
        LayoutError,
        r"^qwen2: no record of its Megatron table takes the canonical tensors "
        r"\['model\.layers\.0\.self_attn\.o_proj\.weight', "
        r"'model\.layers\.1\.self_attn\.o_proj\.weight'\]; add records for them",
    ),
    (
        "table naming a tensor the model does not have",
        _layout_with(
            lambda t: (
                *t,
                MegatronTensor(
                    local="self_attention.linear_q_down_proj.weight",
                    hf="self_attn.q_a_proj.weight",
                    tp=Shard(dim=0),
                ),
            )
        ),
        LayoutError,
        r"^qwen2: its Megatron table names \['model\.layers\.0\.self_attn\.q_a_proj\.weight'\] "
        r"as sources, which are not canonical tensors of this model; fix the family's table",
    ),
    (
        "unknown layout kind",
        lambda: Layout(kind="deepspeed", world_size=1, canonical=(), tensors=()),
        LayoutError,
        r"^Layout\.kind='deepspeed' is not a layout kind; use one of \['fsdp2', 'megatron', "
        r"'inference', 'synthetic'\] \(LayoutKind\)$",
    ),
]


@pytest.mark.parametrize(("what", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_tables_and_kinds_are_refused(what, call, error, message):
    with pytest.raises(error, match=message):
        call()
    assert FAMILIES["qwen2"].megatron[1].fusion is Fusion.QKV  # the registry is left as it was
