"""to_megatron_into writes, into existing tensors, bitwise what to_megatron returns.

Random tiny models x random Megatron / FSDP2 / inference layouts, arbitrary bit
patterns (NaN, inf, -0.0 included), destinations poisoned first: every byte of every
destination is written (padding zeroed), the destination tensors keep their storage,
and each canonical element a rank holds is read exactly once.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.errors import ConversionError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.convert import mapping_reader, to_megatron, to_megatron_into
from areal_fn.sharding.shard import as_bytes
from areal_fn.sharding.strided import view_shape
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.testing.layouts import megatron_layouts_for
from areal_fn.testing.models import model_specs
from tests.laws.test_conversion import random_canonical


def poisoned(layout, rank, dtype):
    """``rank``'s local tensors, every byte 0xFF (a NaN pattern: no value survives unseen)."""
    return poisoned_like(
        {lt.name: torch.empty(lt.shape, dtype=dtype) for lt in layout.local_tensors(rank)}
    )


def poisoned_like(state):
    """Tensors like ``state``'s, every byte 0xFF."""
    out = {}
    for name, t in state.items():
        out[name] = torch.empty_like(t)
        out[name].view(-1).view(torch.uint8).fill_(0xFF)
    return out


def assert_bitwise(got, want):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(as_bytes(got[k]), as_bytes(want[k])), k


def _layouts(data, model):
    kinds = (
        ["fsdp2", "inference"]
        if model.family.megatron_refusal
        else ["megatron", "fsdp2", "inference"]
    )
    kind = data.draw(st.sampled_from(kinds))
    if kind == "megatron":
        return data.draw(megatron_layouts_for(model, max_world=8))
    if kind == "fsdp2":
        return fsdp2_layout(model, ParallelDims(dp=data.draw(st.integers(1, 4))))
    tps = [d for d in (1, 2) if model.num_attention_heads % d == 0]
    tps = [
        d for d in tps if model.intermediate_size % d == 0 and model.num_key_value_heads % d == 0
    ]
    tps = [d for d in tps if (model.moe_intermediate_size or 2) % d == 0]
    return inference_layout(model, ParallelDims(dp=1, tp=data.draw(st.sampled_from(tps))))


@settings(max_examples=40)
@given(st.data())
def test_into_equals_to_megatron_bitwise(data):
    model = data.draw(model_specs())
    layout = _layouts(data, model)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    canon = random_canonical(model, dtype, data.draw(st.integers(0, 1000)))
    rank = data.draw(st.integers(0, layout.world_size - 1))
    want = to_megatron(canon, layout, rank)
    out = poisoned_like(want)  # an all-padding tensor has the model's dtype, others ``dtype``
    ptrs = {k: t.data_ptr() for k, t in out.items()}
    written = to_megatron_into(canon, layout, rank, out=out)
    assert_bitwise(out, want)
    assert {k: t.data_ptr() for k, t in out.items()} == ptrs  # the same storage, written in place
    assert written == sum(t.numel() * t.element_size() for t in want.values())


@settings(max_examples=40)
@given(st.data())
def test_reader_form_reads_each_held_element_once(data):
    model = data.draw(model_specs())
    layout = _layouts(data, model)
    canon = random_canonical(model, torch.float32, 1)
    rank = data.draw(st.integers(0, layout.world_size - 1))
    asked = []
    base = mapping_reader(canon)

    def read(name, box):
        asked.append((name, box))
        return base(name, box)

    want = to_megatron(canon, layout, rank)
    out = poisoned_like(want)
    to_megatron_into(read, layout, rank, out=out)
    assert_bitwise(out, want)
    held = sum(  # a strided piece (gpt-oss experts) holds every step-th element of its box
        math.prod(view_shape(p.canonical_region, p.view)) if p.view else p.canonical_box.numel
        for lt in layout.local_tensors(rank)
        for p in lt.pieces
        if p.canonical
    )
    assert sum(b.numel for _, b in asked) == held
    assert len(asked) == len(set(asked))  # no piece read twice


@settings(max_examples=40)
@given(st.data())
def test_cast_into_other_dtypes_equals_casting_after(data):
    """``cast=True``: bitwise what ``to_megatron`` then ``.to(dtype)`` gives (padding 0)."""
    model = data.draw(model_specs(megatron=True))
    layout = data.draw(megatron_layouts_for(model, max_world=8))
    src, dst = data.draw(
        st.sampled_from([(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
    )
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    canon = {t.name: torch.randn(t.shape, generator=g).to(src) for t in model.tensors}
    rank = data.draw(st.integers(0, layout.world_size - 1))
    want = {k: v.to(dst) for k, v in to_megatron(canon, layout, rank).items()}
    out = poisoned_like(want)
    to_megatron_into(canon, layout, rank, out=out, cast=True)
    assert_bitwise(out, want)


# -- refusals: each names what, which tensor, and the remedy ---------------------------


def _case():
    spec = model_from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
            "torch_dtype": "float32",
        }
    )
    layout = megatron_layout(spec, ParallelDims(tp=2))
    canon = {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype)) for t in spec.tensors}
    return layout, canon


QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def _edit(out, how):
    if how == "missing":
        del out[QKV]
    elif how == "unexpected":
        out["decoder.layers.9.mlp.linear_fc1.weight"] = torch.zeros(2)
    elif how == "misshaped":
        out[QKV] = torch.zeros(3, 3)
    elif how == "meta":
        out[QKV] = torch.empty(out[QKV].shape, device="meta")
    elif how == "dtype":
        out[QKV] = out[QKV].to(torch.bfloat16)
    return out


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "missing",
            rf"cannot hold rank 0's local tensors of the megatron layout: no destination for 1: \['{QKV}'\]",
        ),
        (
            "unexpected",
            r"1 destination\(s\) the rank does not hold: \['decoder.layers.9.mlp.linear_fc1.weight'\]",
        ),
        ("misshaped", rf"mis-shaped 1: \['{QKV}: destination \(3, 3\), layout \(32, 32\)'\]"),
        ("meta", r"1 on the meta device \(no storage\): .*allocate them first \(module.to_empty"),
        (
            "dtype",
            rf"dtypes differ for 1: \['{QKV}: model.layers.0.self_attn.q_proj.weight is torch.float32, the destination torch.bfloat16'\]; pass cast=True",
        ),
    ],
)
def test_bad_destinations_are_refused_before_any_write(how, message):
    layout, canon = _case()
    out = _edit(poisoned(layout, 0, torch.float32), how)
    before = {k: t.clone() for k, t in out.items() if not t.is_meta}
    with pytest.raises(ConversionError, match=message):
        to_megatron_into(canon, layout, 0, out=out)
    assert all(torch.equal(as_bytes(out[k]), as_bytes(v)) for k, v in before.items())


def test_a_reader_returning_the_wrong_shape_or_dtype_is_refused():
    layout, canon = _case()
    base = mapping_reader(canon)
    with pytest.raises(
        ConversionError, match=r"reader returned shape \(1,\) for model\.embed_tokens"
    ):
        to_megatron_into(
            lambda n, b: torch.zeros(1), layout, 0, out=poisoned(layout, 0, torch.float32)
        )
    with pytest.raises(
        ConversionError,
        match=r"embedding.word_embeddings.weight: model.embed_tokens.weight is "
        r"torch.float64, the destination torch.float32; pass cast=True",
    ):
        to_megatron_into(
            lambda n, b: base(n, b).double(), layout, 0, out=poisoned(layout, 0, torch.float32)
        )


def test_canonical_tensors_of_another_model_are_refused():
    layout, canon = _case()
    del canon["model.norm.weight"]
    with pytest.raises(
        ConversionError, match=r"canonical tensors do not match the model: missing 1"
    ):
        to_megatron_into(canon, layout, 0, out=poisoned(layout, 0, torch.float32))
