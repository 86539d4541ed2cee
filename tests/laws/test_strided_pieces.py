"""Laws of strided, transposed pieces (gpt-oss experts under Megatron-Core).

A :class:`~areal_fn.sharding.strided.View` takes every ``step``-th canonical element and
permutes the dims. Checked here against plain torch slicing: the elements a sub-box of a
view's target holds, the Megatron expert tensors of random tiny gpt-oss models (the
formula ``[W[e][:, ::2].T; W[e][:, 1::2].T]``, its bias likewise, ``down[e].T``), bitwise
round trips through every conversion form, and the refusal of code that reads plain
boxes only.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece, Piece
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.plans.convert import iter_to_hf, mapping_reader, to_hf, to_megatron, to_megatron_into
from areal_fn.sharding.box import Box
from areal_fn.sharding.strided import View, sub_box, view_shape, view_slices
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.rules import check_dims
from areal_fn.testing.layouts import megatron_layouts_for
from areal_fn.testing.models import model_specs


@st.composite
def strided_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, View, Box, Box]:
    """A canonical shape, a strided box in it, a view, the target box it fills (extent-1
    dims dropped) and a random sub-box of that target."""
    ndim = draw(st.integers(1, 3))
    step = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
    counts = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    starts = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    ranges = tuple(
        (lo, lo + s * (n - 1) + 1) for lo, s, n in zip(starts, step, counts, strict=True)
    )
    shape = tuple(hi + draw(st.integers(0, 2)) for _, hi in ranges)
    perm = tuple(draw(st.permutations(range(ndim))))
    box, view = Box(ranges=ranges), View(step=step, perm=perm)
    squeezed = [d for d in view_shape(box, view) if d != 1] or [1]
    target = Box(ranges=tuple((0, d) for d in squeezed))
    part = Box(
        ranges=tuple(
            (lo, draw(st.integers(lo + 1, d)))
            for d in squeezed
            for lo in [draw(st.integers(0, d - 1))]
        )
    )
    return shape, box, view, target, part


@given(strided_cases())
def test_sub_box_holds_the_elements_of_the_sub_target(case) -> None:  # type: ignore[no-untyped-def]
    shape, box, view, target, part = case
    t = torch.arange(math.prod(shape)).reshape(shape)
    full = t[view_slices(box, view)].permute(view.perm).reshape(target.shape)
    sub = sub_box(box, view, target, part)
    got = t[view_slices(sub, view)].permute(view.perm).reshape(part.shape)
    assert torch.equal(got, full[part.slices()])


def _gpt_oss_dims(model, data) -> ParallelDims:  # type: ignore[no-untyped-def]
    """tp, ep and pp that divide the drawn model (etp stays 1: expert biases)."""
    choices = []
    for tp in (1, 2):
        for ep in (1, 2):
            for pp in (1, 2):
                dims = ParallelDims(tp=tp, ep=ep, pp=pp, dp=ep if tp == 1 else 1)
                try:
                    check_dims(model, "megatron", dims)
                    if model.num_layers % pp == 0:
                        choices.append(dims)
                except (LayoutError, ValueError):
                    continue
    return data.draw(st.sampled_from(choices))


@settings(max_examples=30)
@given(st.data())
def test_megatron_experts_are_the_transposed_de_interleaved_slices(data) -> None:  # type: ignore[no-untyped-def]
    model = data.draw(model_specs("gpt_oss", max_layers=2))
    dims = _gpt_oss_dims(model, data)
    layout = megatron_layout(model, dims)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    per_rank = model.num_experts // dims.ep
    for rank in range(layout.world_size):
        local = to_megatron(canon, layout, rank)
        coords = dict(zip(layout.meshes[-1].names, layout.meshes[-1].coords(rank), strict=True))
        for name, t in local.items():
            if ".local_experts." not in name:
                continue
            i = int(name.split(".local_experts.")[1].split(".")[0])
            e = coords["ep"] * per_rank + i
            layer = layout.stages.chunk_layers(coords["pp"])[int(name.split(".")[2])]
            hp = f"model.layers.{layer}.mlp.experts."
            w, b = canon[hp + "gate_up_proj"][e], canon[hp + "gate_up_proj_bias"][e]
            want = {
                "linear_fc1.weight": torch.cat([w[:, 0::2].T, w[:, 1::2].T]),
                "linear_fc1.bias": torch.cat([b[0::2], b[1::2]]),
                "linear_fc2.weight": canon[hp + "down_proj"][e].T,
                "linear_fc2.bias": canon[hp + "down_proj_bias"][e],
            }[name.split(f".local_experts.{i}.")[1]]
            assert torch.equal(t, want), name


@settings(max_examples=25)
@given(st.data())
def test_every_conversion_form_round_trips_bitwise(data) -> None:  # type: ignore[no-untyped-def]
    model = data.draw(model_specs("gpt_oss", max_layers=3))
    layout = data.draw(megatron_layouts_for(model, max_world=8))
    assert any(t.is_strided for t in layout.tensors)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    states = {}
    for r in range(layout.world_size):
        states[r] = to_megatron(canon, layout, r)
        into = {n: torch.full_like(t, float("nan")) for n, t in states[r].items()}
        to_megatron_into(mapping_reader(canon), layout, r, out=into)
        assert all(torch.equal(into[n], states[r][n]) for n in states[r])
    back = to_hf(states, layout, check_replicas=True)
    assert list(back) == list(canon)
    assert all(torch.equal(back[n], canon[n]) for n in canon)
    assert [n for n, _ in iter_to_hf(states, layout)] == list(canon)


def test_a_strided_piece_has_no_plain_box() -> None:
    box = Box(ranges=((0, 1), (0, 4), (1, 8)))
    view = View(step=(1, 1, 2), perm=(0, 2, 1))
    rows = Box(ranges=((4, 8), (0, 4)))
    piece = FusionPiece(canonical="w", canonical_box=box, logical_box=rows, view=view)
    assert piece.numel == 16 and piece.canonical_region == box
    message = (
        r"the piece of 'w' at \[0:1, 0:4, 1:8\] is strided/transposed \(view "
        r"step\(1, 1, 2\)perm\(0, 2, 1\): a gpt-oss expert of a Megatron layout\); this code "
        r"reads plain canonical boxes only\. Conversion \(areal_fn\.plans\.convert\) handles "
        r"such pieces; code that places boxes lifts the layout first "
        r"\(areal_fn\.layouts\.lift\), as transfer and checkpoint plans do$"
    )
    with pytest.raises(LayoutError, match=message):
        _ = piece.canonical_box
    local = Piece(canonical="w", canonical_box=box, local_box=rows, view=view)
    with pytest.raises(LayoutError, match=message):
        local.local_of(box)
    assert eval(repr(piece)) == piece and eval(repr(local)) == local


@pytest.mark.parametrize(
    ("box", "view", "target", "message"),
    [
        (
            Box(ranges=((0, 4),)),
            View(step=(2,), perm=(0,)),
            Box(ranges=((0, 2),)),
            r"canonical box \[0:4\] does not end at its last element under step \(2,\) "
            r"\(dims \[0\]\); give stop = start \+ step \* \(n - 1\) \+ 1",
        ),
        (
            Box(ranges=((0, 3), (0, 2))),
            View(step=(1, 1), perm=(1, 0)),
            Box(ranges=((0, 3), (0, 2))),
            r"canonical box \[0:3, 0:2\] under view step\(1, 1\)perm\(1, 0\) has shape \(2, 3\), "
            r"its target box \[0:3, 0:2\] \(3, 2\); they must match element for element",
        ),
    ],
)
def test_a_view_that_does_not_fill_its_target_is_refused(box, view, target, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LayoutError, match=message):
        FusionPiece(canonical="w", canonical_box=box, logical_box=target, view=view)


def test_a_view_needs_a_permutation_and_positive_steps() -> None:
    with pytest.raises(LayoutError, match=r"step needs one int >= 1 per canonical dim"):
        View(step=(1, 0), perm=(0, 1))
    with pytest.raises(LayoutError, match=r"perm a permutation of those dims"):
        View(step=(1, 1), perm=(0, 0))


#: A gpt-oss config small enough for tables of refusals (2 layers of 2 experts).
TINY_GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 8,
    "intermediate_size": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "vocab_size": 16,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
}


def test_expert_tensor_parallelism_is_refused_for_biased_experts() -> None:
    from areal_fn.model.spec import model_from_hf_config

    model = model_from_hf_config(TINY_GPT_OSS)
    with pytest.raises(
        LayoutError,
        match=r"etp=2: Megatron-Core refuses expert tensor parallelism for experts with biases "
        r"\(gpt_oss's experts have them\); use etp=1 \(ep and tp stay free\)",
    ):
        megatron_layout(model, ParallelDims(tp=2, etp=2))
