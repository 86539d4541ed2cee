"""Weight-sync plans over layouts with strided pieces (gpt-oss experts under Megatron-Core).

The planner places them in the lifted basis (:mod:`areal_fn.layouts.lift`). The oracle
is independent of lifting: each layout's local tensors come from the conversion
(``to_megatron``, which reads strided pieces with torch's own slicing and permutes), for
random tiny gpt-oss models, random Megatron layouts and random FSDP2 / inference /
Megatron partners, both directions, colocated and disjoint ranks, whole plans, one
rank's rows, buckets, and the lower bound.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn import ParallelDims, fsdp2_layout, inference_layout, megatron_layout
from areal_fn.errors import LayoutError, PlanError
from areal_fn.layouts.layout import FusionPiece, Layout, LogicalTensor
from areal_fn.layouts.lift import (
    LocalView,
    apply_view,
    lift_box,
    lift_layouts,
    lifted_shape,
    unlift_box,
)
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.plans.convert import to_megatron
from areal_fn.plans.transfer import bucket, plan_rank_transfers, plan_transfers
from areal_fn.plans.transfer.apply import apply_transfers
from areal_fn.plans.transfer.bound import transfer_lower_bound
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Replicate, Shard
from areal_fn.sharding.sharding import Sharding
from areal_fn.sharding.strided import View
from areal_fn.strategy.rules import dims_problems
from areal_fn.testing.layouts import inference_dims_for, megatron_layouts_for
from areal_fn.testing.models import model_specs
from tests.laws.test_strided_pieces import TINY_GPT_OSS


@st.composite
def partners(draw: st.DrawFn, model: ModelSpec) -> Layout:
    kind = draw(st.sampled_from(["fsdp2", "inference", "megatron"]))
    if kind == "megatron":
        return draw(megatron_layouts_for(model, max_world=8))
    if kind == "inference":
        return inference_layout(model, draw(inference_dims_for(model, max_world=8)))
    dp = draw(st.integers(1, 3))
    tps = [d for d in (1, 2) if not dims_problems(model, "fsdp2", ParallelDims(dp=dp, tp=d))]
    return fsdp2_layout(model, ParallelDims(dp=dp, tp=draw(st.sampled_from(tps))))


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelSpec, Layout, Layout, list[int], list[int]]:
    model = draw(model_specs("gpt_oss", max_layers=2))
    strided = draw(megatron_layouts_for(model, max_world=8))
    other = draw(partners(model))
    src, dst = (strided, other) if draw(st.booleans()) else (other, strided)
    if draw(st.booleans()):
        sr, dr = list(range(src.world_size)), list(range(dst.world_size))
    else:
        ranks = draw(st.permutations(range(src.world_size + dst.world_size)))
        sr, dr = list(ranks[: src.world_size]), list(ranks[src.world_size :])
    return model, src, dst, sr, dr


def states(model: ModelSpec, layout: Layout, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    return {r: to_megatron(canon, layout, r) for r in range(layout.world_size)}


def blank(want: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    return {r: {n: torch.full_like(t, float("nan")) for n, t in d.items()} for r, d in want.items()}


def check(want: dict[int, dict[str, torch.Tensor]], got: dict[int, dict[str, torch.Tensor]]):
    for r, tensors in want.items():
        for name, t in tensors.items():
            # padding (a vocab-padded embedding's rows) is not transferred: it stays NaN
            assert torch.equal(got[r][name].nan_to_num(0.0), t), (r, name)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_a_sync_plan_reproduces_every_destination_tensor(case) -> None:  # type: ignore[no-untyped-def]
    model, src, dst, sr, dr = case
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    assert plan.lifted and (plan.src_views or plan.dst_views)
    src_t = {g: t for g, t in zip(sr, states(model, src, 3).values(), strict=True)}
    want = {g: t for g, t in zip(dr, states(model, dst, 3).values(), strict=True)}
    got = blank(want)
    apply_transfers(plan.transfers, src_t, got, src_views=plan.src_views, dst_views=plan.dst_views)
    check(want, got)
    # one rank's rows alone are that rank's rows of the whole plan
    for g in sorted({*sr, *dr})[:3]:
        assert plan_rank_transfers(src, dst, g, src_ranks=sr, dst_ranks=dr).transfers == (
            plan.for_rank(g)
        )
    # the bound counts the elements the destination ranks lack, in bytes
    assert plan.bytes_total >= transfer_lower_bound(src, dst, src_ranks=sr, dst_ranks=dr)
    # buckets cut the lifted boxes and still reproduce every tensor
    cut = bucket(plan, 40)
    again = blank(want)
    apply_transfers(cut.transfers, src_t, again, src_views=cut.src_views, dst_views=cut.dst_views)
    check(want, again)


MODEL = model_from_hf_config(TINY_GPT_OSS)


def test_the_megatron_expert_views_are_views_of_the_parameters() -> None:
    (lifted,) = lift_layouts(megatron_layout(MODEL, ParallelDims(tp=2)))
    views = dict(lifted.views)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert str(views[fc1]) == (
        "unflatten(0, 2, 4).movedim(0, 0).reshape(2, 1, 4, 8).permute(0, 1, 3, 2).movedim(0, 3)"
    )
    w = torch.randn(8, 8)  # [2I, H]: gate units, then up units
    v = apply_view(views[fc1], w)
    assert v.shape == (1, 8, 4, 2) and v.data_ptr() == w.data_ptr()
    # element [0, h, u, g] is W[e][h, 2u + g]: gate unit u is fc1 row u, up unit u row I + u
    assert torch.equal(v[0, :, :, 0], w[:4].T) and torch.equal(v[0, :, :, 1], w[4:].T)
    v[0, 2, 3, 1] = 7.0
    assert w[7, 2] == 7.0
    fc2 = views["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert str(fc2) == "reshape(1, 8, 4).permute(0, 2, 1)"
    assert lifted.factors == (
        ("model.layers.0.mlp.experts.gate_up_proj", (1, 1, 2)),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", (1, 2)),
        ("model.layers.1.mlp.experts.gate_up_proj", (1, 1, 2)),
        ("model.layers.1.mlp.experts.gate_up_proj_bias", (1, 2)),
    )


def test_a_tensor_of_the_wrong_shape_is_refused_with_its_name() -> None:
    src, dst = (
        megatron_layout(MODEL, ParallelDims(tp=2)),
        inference_layout(MODEL, ParallelDims(tp=2)),
    )
    plan = plan_transfers(src, dst)
    tensors, out = states(MODEL, src, 0), blank(states(MODEL, dst, 0))
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    tensors[0][fc1] = torch.zeros(7, 8)
    with pytest.raises(
        PlanError,
        match=rf"source tensor '{fc1}' of shape \(7, 8\) cannot be viewed as unflatten\(0, 2, 4\)"
        r".*; pass the tensor the layout describes",
    ):
        apply_transfers(plan.transfers, tensors, out, src_views=plan.src_views)


def _one(name: str, shape, fusion, placements=None) -> LogicalTensor:  # type: ignore[no-untyped-def]
    mesh = Mesh.of(tp=2)
    return LogicalTensor(
        name=name,
        shape=shape,
        dtype="float32",
        fusion=fusion,
        sharding=Sharding(mesh=mesh, placements=placements or (Replicate(),)),
    )


def _layout(*tensors: LogicalTensor, shape=(4, 6)) -> Layout:  # type: ignore[no-untyped-def]
    return Layout(
        kind="synthetic",
        world_size=2,
        canonical=(TensorSpec(name="w", shape=shape, dtype="float32"),),
        tensors=tensors,
    )


STEP2 = View(step=(1, 2), perm=(1, 0))


def _phase(g: int, rows: tuple[int, int]) -> FusionPiece:
    return FusionPiece(
        canonical="w",
        canonical_box=Box(ranges=((0, 4), (g, 5 + g))),
        logical_box=Box(ranges=(rows, (0, 4))),
        view=STEP2,
    )


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            _layout(_one("w1", (3, 4), (_phase(0, (0, 3)),))),
            r"w1: its strided pieces cannot be lifted to a plain box: its 1 pieces are not "
            r"the 2 phases of step 2; transfer and checkpoint plans place strided pieces that "
            r"together fill a plain box of one canonical tensor",
        ),
        (
            _layout(_one("w1", (6, 4), (_phase(0, (0, 3)), _phase(1, (3, 6))), (Shard(0),))),
            r"w1: its strided pieces cannot be lifted to a plain box: it is sharded \(S\(0\)\), "
            r"not replicated",
        ),
        (
            _layout(_one("w1", (6, 4), (_phase(1, (0, 3)), _phase(0, (3, 6))))),
            r"its phases are not stacked in order along one dim of \(6, 4\)",
        ),
    ],
)
def test_strided_pieces_that_fill_no_plain_box_are_refused(layout, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LayoutError, match=message):
        lift_layouts(layout)


def test_a_plain_shard_that_cuts_inside_units_is_refused() -> None:
    strided = _layout(_one("w1", (6, 4), (_phase(0, (0, 3)), _phase(1, (3, 6)))))
    whole = FusionPiece(canonical="w", canonical_box=Box.full((4, 6)), logical_box=Box.full((4, 6)))
    # Shard(1) over 2 ranks gives columns 0:3 and 3:6: unit 1 (columns 2, 3) is cut
    cut = _layout(_one("w", (4, 6), (whole,), (Shard(1),)))
    with pytest.raises(
        PlanError,
        match=r"weight-sync planning: w: its sharding \(S\(1\)\) cuts inside units of \(1, 2\) on "
        r"rank 0; lifting needs shards of whole units",
    ):
        plan_transfers(strided, cut)
    ok = _layout(_one("w", (4, 6), (whole,), (Shard(0),)))
    plan = plan_transfers(strided, ok)
    assert dict(plan.dst_views)["w"] == LocalView(ops=(("unflatten", (1, -1, 2)),))


@st.composite
def aligned_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], Box]:
    """A shape, a step per dim dividing it, and a box of whole units."""
    ndim = draw(st.integers(1, 3))
    steps = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(ndim))
    units = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    ranges = []
    for n in units:
        lo = draw(st.integers(0, n - 1))
        ranges.append((lo, draw(st.integers(lo + 1, n))))
    shape = tuple(u * s for u, s in zip(units, steps, strict=True))
    box = Box(ranges=tuple((lo * s, hi * s) for (lo, hi), s in zip(ranges, steps, strict=True)))
    return shape, steps, box


@given(aligned_boxes())
def test_a_lifted_box_holds_the_same_elements_in_the_same_order(case) -> None:  # type: ignore[no-untyped-def]
    shape, steps, box = case
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    up = lift_box(box, steps)
    assert up is not None and unlift_box(up, steps) == box
    lifted = t.view(lifted_shape(shape, steps))
    assert torch.equal(lifted[up.slices()].reshape(-1), t[box.slices()].reshape(-1))
    # a box that cuts inside a unit of a dim of step > 1 has no lifted form, and a lifted
    # box that takes some phases only (a strided region) no plain one
    i = 0
    for s in steps:
        if s > 1:
            some = (*up.ranges[: i + 1], (0, 1), *up.ranges[i + 2 :])
            assert unlift_box(Box(ranges=some), steps) is None
        i += 2 if s > 1 else 1
    for d, s in enumerate(steps):
        if s > 1:
            lo, hi = box.ranges[d]
            cut = Box(ranges=(*box.ranges[:d], (lo, hi - 1), *box.ranges[d + 1 :]))
            assert lift_box(cut, steps) is None
