"""Laws of per-rank transfer plans: each rank's plan is exactly its rows of the whole
plan, and both ends of every row put it in the same bucket without talking."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.plans.transfer import bucket, grid_step, plan_rank_transfers, plan_transfers
from tests.laws.test_transfer import placed_pairs

ROOT = Path(__file__).resolve().parents[2]


def _rank_plans(src, dst, sr, dr):  # type: ignore[no-untyped-def]
    ranks = sorted({*sr, *dr})
    return {r: plan_rank_transfers(src, dst, r, src_ranks=sr, dst_ranks=dr) for r in ranks}


@given(placed_pairs())
def test_rank_plans_are_the_rows_of_the_full_plan(case):
    src, dst, sr, dr = case
    full = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    mine = _rank_plans(src, dst, sr, dr)
    for r, plan in mine.items():
        assert plan.transfers == tuple(t for t in full.transfers if r in (t.src, t.dst)), r
        assert (plan.src_ranks, plan.dst_ranks) == (full.src_ranks, full.dst_ranks)
    # every row of the full plan is in the plans of both its ranks, and in no other
    for t in full.transfers:
        holders = {r for r, plan in mine.items() if t in plan.transfers}
        assert holders == {t.src, t.dst}
    outside = max(*sr, *dr) + 1
    assert plan_rank_transfers(src, dst, outside, src_ranks=sr, dst_ranks=dr).transfers == ()


@given(placed_pairs(), st.integers(4, 64))
def test_sender_and_receiver_agree_on_buckets(case, max_bytes):
    """Bucketing a rank's own plan gives that rank's rows of the whole plan's buckets,
    under the same indices; so a sender and a receiver, each from its own plan, agree
    on every bucket's contents between them."""
    src, dst, sr, dr = case
    full = bucket(plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr), max_bytes, version=2)
    mine = {r: bucket(p, max_bytes, version=2) for r, p in _rank_plans(src, dst, sr, dr).items()}

    def rows(bp, keep):  # type: ignore[no-untyped-def]
        return [(b.index, t) for b in bp.buckets for t in b.transfers if keep(t)]

    for r, bp in mine.items():
        assert rows(bp, lambda t: True) == rows(full, lambda t, r=r: r in (t.src, t.dst))
        assert all(b.transfers for b in bp.buckets)
    for s in sr:
        for d in dr:
            if s == d:
                continue
            pair = lambda t, s=s, d=d: (t.src, t.dst) == (s, d)  # noqa: E731
            assert rows(mine[s], pair) == rows(mine[d], pair)


@given(placed_pairs(), st.integers(1, 64))
def test_rows_lie_end_to_end_on_the_byte_clock(case, max_bytes):
    """Offsets increase along the plan, rows never overlap, each canonical tensor starts
    on a multiple of its element size, and gaps are only that alignment: the clock is
    as long as the bytes it counts. No bucket straddles an element."""
    src, dst, sr, dr = case
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    end = 0
    for t in plan.transfers:
        itemsize = t.nbytes // t.box.numel
        assert t.offset % itemsize == 0
        assert 0 <= t.offset - end < itemsize
        end = t.offset + t.nbytes
    assert end == sum(t.nbytes for t in plan.transfers)  # float32 only: no gaps at all
    step = grid_step(max_bytes)
    if plan.transfers and max_bytes >= 4:
        for b in bucket(plan, max_bytes).buckets:
            for t in b.transfers:
                assert b.index * step <= t.offset and t.offset + t.nbytes <= (b.index + 1) * step


@pytest.mark.parametrize("max_bytes", [*range(1, 20), 64, 100, 1 << 20])
def test_grid_step_is_a_multiple_of_every_element_that_fits(max_bytes):
    step = grid_step(max_bytes)
    assert 0 < step <= max_bytes
    assert all(step % size == 0 for size in (1, 2, 4, 8) if size <= max_bytes)


def _tiny_moe(layers: int) -> dict[str, object]:
    cfg = json.loads((ROOT / "specs" / "models" / "Qwen3-235B-A22B.json").read_text())
    cfg.update(
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        vocab_size=256,
        num_experts=8,
        num_hidden_layers=layers,
    )
    return cfg


@pytest.mark.parametrize("colocated", [False, True])
def test_tensors_sharing_geometry_are_planned_once_per_class(colocated):
    """A MoE model with 4 or 16 layers (8 experts each), Megatron ``d2p2t2e4`` -> SGLang
    ``t4`` x 2: the number of planned classes does not grow with layers or experts (when
    ranks are disjoint), and the rank plans stay the rows of the full plan."""
    from areal_fn import ParallelDims, inference_layout, megatron_layout, model_from_hf_config
    from areal_fn.plans.transfer.classes import Planner

    counts = []
    for layers in (4, 16):
        model = model_from_hf_config(_tiny_moe(layers))
        src = megatron_layout(model, ParallelDims(dp=2, pp=2, tp=2, ep=4))
        dst = inference_layout(model, ParallelDims(dp=2, tp=4))
        sr = tuple(range(8))
        dr = tuple(range(8)) if colocated else tuple(range(8, 16))
        planner = Planner(src, dst, sr, dr)
        full = planner.world()
        counts.append(len(planner._templates))
        for r in sorted({*sr, *dr}):
            assert Planner(src, dst, sr, dr).rank(r) == [t for t in full if r in (t.src, t.dst)]
    if not colocated:
        assert counts[0] == counts[1]
    assert counts[1] < 16 * 8  # far fewer classes than canonical expert tensors
