"""Weight-sync planning at scale: one rank's plan and the whole plan, before and after.

Cases (layouts built once, untimed), trainer ranks first, then the inference ranks:

- Qwen3-235B-A22B, Megatron ``d8p8t4e32`` (256 ranks, 94 layers split evenly over 8
  stages) -> SGLang ``t8`` x 8 replicas (64 ranks);
- DeepSeek-V3, Megatron ``d8p8t8e64`` (512 ranks, 61 layers over 8 stages) -> SGLang
  ``t8`` x 8 replicas (64 ranks);
- gpt-oss-120b, Megatron ``d8p4t2e16`` (64 ranks, 36 layers over 4 stages; its experts
  are strided pieces, planned in the lifted basis) -> SGLang ``t8`` x 8 replicas (64
  ranks): after only, the planner before refused strided pieces. The time of lifting
  the two layouts (part of every call) is printed apart.

Times are CPU seconds of this process (``time.process_time``: one core), best of
``REPEATS`` for the rank plans (the first call is printed too):

- **before**: the planner as it was (``bench/sync_plan_baseline.py``) on one replica (8
  destination ranks), times 8 for the whole plan (replicas plan against the same
  sources). Its source balancing runs over every destination planned before, so one
  rank's rows need that whole plan too.
- **after**: ``plan_rank_transfers`` for the first destination rank (it receives from
  every stage) and for source rank 0 (stage 0, the embedding), and ``plan_transfers``
  over all 64 destination ranks.

Memory is the ``tracemalloc`` peak of a separate run of the same call, shown with the
transfers the result keeps. Balance is the most bytes any source rank sends over the
mean (1.00 is perfect). Run: ``.venv/bin/python -m bench sync_plan``.
"""

import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.layouts.inference import inference_layout  # noqa: E402
from areal_fn.layouts.layout import Layout  # noqa: E402
from areal_fn.layouts.lift import lift_layouts  # noqa: E402
from areal_fn.layouts.megatron import megatron_layout  # noqa: E402
from areal_fn.model.spec import model_from_hf_config  # noqa: E402
from areal_fn.pipeline.partition import split_evenly  # noqa: E402
from areal_fn.plans.transfer import TransferPlan, plan_rank_transfers, plan_transfers  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402
from areal_fn.strategy.rules import check_dims  # noqa: E402
from bench.sync_plan_baseline import plan_transfers_before  # noqa: E402

REPEATS = 2
CASES = (
    ("Qwen3-235B-A22B", "d8p8t4e32", ParallelDims(dp=8, pp=8, tp=4, ep=32)),
    ("DeepSeek-V3", "d8p8t8e64", ParallelDims(dp=8, pp=8, tp=8, ep=64)),
)
INFER = ParallelDims(dp=8, tp=8)
GOALS = {"rank": 1.0, "world": 10.0}
STRIDED = ("gpt-oss-120b", "d8p4t2e16", ParallelDims(dp=8, pp=4, tp=2, ep=16))


def _cpu(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, Any, float]:
    """(best CPU seconds, the result, CPU seconds of the first call)."""
    times, out = [], None
    for _ in range(repeats):
        out = None
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return min(times), out, times[0]


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del out
    return peak


def _layouts(name: str, dims: ParallelDims) -> tuple[Layout, Layout, Layout]:
    """(Megatron layout, all inference replicas, one inference replica)."""
    spec = model_from_hf_config(
        json.loads((ROOT / "specs" / "models" / f"{name}.json").read_text())
    )
    check_dims(spec, "megatron", dims)
    check_dims(spec, "sglang", INFER)
    stages = split_evenly([1.0] * spec.num_layers, dims.pp)
    replica = inference_layout(spec, ParallelDims(tp=INFER.tp))
    return megatron_layout(spec, dims, stages=stages), inference_layout(spec, INFER), replica


def _case(name: str, label: str, dims: ParallelDims) -> None:
    src, dst, replica = _layouts(name, dims)
    n_src, n_dst = src.world_size, dst.world_size
    sr, dr = range(n_src), range(n_src, n_src + n_dst)
    print(
        f"{name} ({len(src.canonical)} canonical tensors): megatron {label} ({n_src} ranks) -> "
        f"sglang t{INFER.tp} x {INFER.dp} ({n_dst} ranks)"
    )
    before_s, before, _ = _cpu(
        lambda: plan_transfers_before(
            src, replica, src_ranks=sr, dst_ranks=range(n_src, n_src + INFER.tp)
        )
    )
    world_before = INFER.dp * before_s
    rows: dict[str, tuple[float, TransferPlan, float]] = {}
    for what, rank in (("rank", n_src), ("src", 0)):
        rows[what] = _cpu(
            lambda rank=rank: plan_rank_transfers(src, dst, rank, src_ranks=sr, dst_ranks=dr),
            REPEATS,
        )
    world_s, world, _ = _cpu(lambda: plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr))
    sent = world.send_bytes()
    balance = max(sent.values()) / (sum(sent.values()) / len(sent))
    before_sent = list(before.send_bytes().values())
    before_balance = max(before_sent) / (sum(before_sent) / len(before_sent))
    n_world, n_rank, n_src_rank = (
        len(world.transfers),
        len(rows["rank"][1].transfers),
        len(rows["src"][1].transfers),
    )
    same = rows["rank"][1].transfers == world.for_rank(n_src)
    del world, before
    peaks = {
        "rank": _peak(lambda: plan_rank_transfers(src, dst, n_src, src_ranks=sr, dst_ranks=dr)),
        "src": _peak(lambda: plan_rank_transfers(src, dst, 0, src_ranks=sr, dst_ranks=dr)),
        "world": _peak(lambda: plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)),
    }
    mib = 1 << 20
    print(
        f"  before: one replica {before_s:.2f} s -> whole plan (x{INFER.dp}) {world_before:.1f} s"
    )
    for what, label2, n in (
        ("rank", f"destination rank {n_src}", n_rank),
        ("src", "source rank 0", n_src_rank),
    ):
        s, first = rows[what][0], rows[what][2]
        print(
            f"  after: {label2}: {s:.2f} s (first call {first:.2f} s), {n} transfers, peak {peaks[what] / mib:.0f} MiB "
            f"({peaks[what] / max(n, 1):.0f} B/transfer); {world_before / s:.0f}x faster than "
            f"the whole plan it needed before; goal < {GOALS['rank']:.0f} s: "
            f"{'met' if s < GOALS['rank'] else 'NOT met'}"
        )
    print(
        f"  after: whole plan {world_s:.2f} s, {n_world} transfers, peak "
        f"{peaks['world'] / mib:.0f} MiB ({peaks['world'] / n_world:.0f} B/transfer); "
        f"{world_before / world_s:.1f}x faster; goal < {GOALS['world']:.0f} s: "
        f"{'met' if world_s < GOALS['world'] else 'NOT met'}"
    )
    print(
        f"  rank plan = its rows of the whole plan: {same}; most sent / mean: after "
        f"{balance:.2f} (all {n_src} sources), before {before_balance:.2f} (one replica)"
    )


def _strided_case(name: str, label: str, dims: ParallelDims) -> None:
    src, dst, _ = _layouts(name, dims)
    n_src, n_dst = src.world_size, dst.world_size
    sr, dr = range(n_src), range(n_src, n_src + n_dst)
    strided = sum(t.is_strided for t in src.tensors)
    print(
        f"{name} ({len(src.canonical)} canonical tensors, {strided} strided Megatron tensors): "
        f"megatron {label} ({n_src} ranks) -> sglang t{INFER.tp} x {INFER.dp} ({n_dst} ranks)"
    )
    lift_s, _, _ = _cpu(lambda: lift_layouts(src, dst), REPEATS)
    print(f"  lifting both layouts: {lift_s:.2f} s (inside every call below)")
    plans = {}
    for label2, rank in ((f"destination rank {n_src}", n_src), ("source rank 0", 0)):
        s, plans[rank], first = _cpu(
            lambda rank=rank: plan_rank_transfers(src, dst, rank, src_ranks=sr, dst_ranks=dr),
            REPEATS,
        )
        print(
            f"  {label2}: {s:.2f} s (first call {first:.2f} s), {len(plans[rank].transfers)} "
            f"transfers; goal < {GOALS['rank']:.0f} s: {'met' if s < GOALS['rank'] else 'NOT met'}"
        )
    world_s, world, _ = _cpu(lambda: plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr))
    same = all(p.transfers == world.for_rank(r) for r, p in plans.items())
    print(
        f"  whole plan {world_s:.2f} s, {len(world.transfers)} transfers; goal < "
        f"{GOALS['world']:.0f} s: {'met' if world_s < GOALS['world'] else 'NOT met'}; "
        f"rank plans = their rows of the whole plan: {same}"
    )


def run() -> None:
    for name, label, dims in CASES:
        _case(name, label, dims)
    _strided_case(*STRIDED)


if __name__ == "__main__":
    run()
