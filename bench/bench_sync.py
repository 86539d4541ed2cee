"""Weight sync: planned shard-to-shard transfers vs gather-full-then-broadcast.

Part 1 (4 CPU processes under torchrun, gloo): a Qwen2.5-0.5B-shaped model (all 24
layers, bf16, random values; tied embeddings), trainer ``fsdp:d2`` on ranks 0-1,
inference ``sglang:t2`` on ranks 2-3. Two ways to bring the trained weights to the
inference ranks, each timed over ``REPEATS`` rounds, the schemes taking turns within a
round (barrier to barrier, wall time; best of the rounds, and against the bare
transport also each round's ratio and their median):

- **planned**: :func:`~areal_fn.plans.transfer.plan_transfers` from the FSDP2 layout to the
  inference layout, bucketed (``BUCKET_MB``), executed by
  :func:`~areal_fn.runtime.sync.executor.send_and_receive`: each inference rank receives
  exactly its shard, from both trainer ranks at once, staged and committed atomically
  (``keep_staging=True``: the group keeps its staging memory from sync to sync; the row
  **planned_fresh** is the default, which hands it back after each sync; the row
  **planned_swap** keeps it and commits by swapping storages, ``commit="swap"``);
- **gather + broadcast** (the scheme AReaL ships): for every parameter, the trainer
  ranks all-gather it (``DTensor.full_tensor()``), rank 0 broadcasts the full tensor to
  the inference ranks (one ``broadcast`` per tensor over a group of rank 0 and the
  inference ranks), and each inference rank keeps its shard.

A third row runs the planned sync with the transfers reordered so that every bucket
feeds both inference ranks (:func:`interleaved`; ``plan_transfers`` orders by
destination rank, so its buckets feed one receiver at a time).

A fourth row, **bare**, is the limit of this process layout: the planned sync's own
messages (same pairs, same buckets, same sizes, same posting order) as raw gloo sends
and receives of preallocated, already touched buffers, with no packing, MAC, staging
or store; the benchmark prints its bandwidth and the planned sync's ratio to it
(goal ``GOAL_OF_BARE``).

Bytes moved count what every process receives: the all-gather (each trainer rank gets
the other half), the broadcasts (every inference rank gets every full tensor), the
planned messages (each inference rank gets its shard). Both end bitwise equal (checked).

Part 2: planning time for Qwen3-235B-A22B from a 256-rank Megatron layout
(``d8p8t4e32``, 94 layers split 12/12/12/12/12/12/11/11) to SGLang ``t8`` x 8 replicas
(64 ranks). Planning one destination replica (8 ranks) is timed and the full plan
extrapolated (x 8: replicas plan independently against the same sources).

Run: ``.venv/bin/python -m bench sync``.
"""

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.layouts.fsdp2 import fsdp2_layout  # noqa: E402
from areal_fn.layouts.inference import inference_layout  # noqa: E402
from areal_fn.layouts.layout import Layout  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.transfer import BucketPlan, Transfer, TransferPlan, bucket, plan_transfers  # noqa: E402
from areal_fn.plans.transfer.bound import transfer_lower_bound  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from areal_fn.runtime.sync.executor import SyncGroup

MODEL = ROOT / "specs" / "models" / "Qwen2.5-0.5B.json"
BIG = ROOT / "specs" / "models" / "Qwen3-235B-A22B.json"
WORLD = 4
TRAINER, INFER = (0, 1), (2, 3)
BUCKET_MB = 64
REPEATS = 6  # rounds; the schemes take turns within each
GOAL_OF_BARE = 0.8  # the planned sync's bandwidth over the bare transport's


def small_spec() -> ModelSpec:
    return model_from_hf_config(json.loads(MODEL.read_text()))


# ----------------------------------------------------------------------------- worker
def interleaved(plan: TransferPlan) -> TransferPlan:
    """``plan`` with its transfers reordered: per canonical tensor, destination by
    destination, so that every bucket feeds every receiver (a proposed bucket order;
    ``plan_transfers`` orders by destination rank first)."""
    by: dict[tuple[str, int], list[Transfer]] = {}
    for t in plan.transfers:
        by.setdefault((t.canonical, t.dst), []).append(t)
    order = [
        t
        for name in dict.fromkeys(t.canonical for t in plan.transfers)
        for dst in plan.dst_ranks
        for t in by.get((name, dst), ())
    ]
    return attrs.evolve(plan, transfers=tuple(order))


def _local_tensors(
    rank: int, train: Layout, infer: Layout, dtype: "torch.dtype"
) -> tuple[dict[str, "torch.Tensor"], dict[str, "torch.Tensor"]]:
    """(sources, live): random trainer shards on trainer ranks, zeroed inference shards on
    inference ranks."""
    import torch

    src: dict[str, torch.Tensor] = {}
    live: dict[str, torch.Tensor] = {}
    if rank in TRAINER:
        gen = torch.Generator().manual_seed(rank)
        for lt in train.local_tensors(rank):
            src[lt.name] = torch.empty(lt.shape, dtype=dtype).uniform_(-1, 1, generator=gen)
    else:
        for lt in infer.local_tensors(rank - INFER[0]):
            live[lt.name] = torch.zeros(lt.shape, dtype=dtype)
    return src, live


def _planned(
    plan: BucketPlan,
    src: dict[str, "torch.Tensor"],
    live: dict[str, "torch.Tensor"],
    group: "SyncGroup",
    keep_staging: bool = True,
    commit: str = "copy",
) -> Callable[[], dict[str, int]]:
    from areal_fn.runtime.sync.executor import send_and_receive

    def planned() -> dict[str, int]:
        report = send_and_receive(
            plan,
            src_tensors=src,
            dst_tensors=live,
            group=group,
            keep_staging=keep_staging,
            commit=commit,
        )
        return {"received": report.bytes_received, "overhead": report.overhead_bytes}

    return planned


def _bare(
    plan: BucketPlan,
    src: dict[str, "torch.Tensor"],
    live: dict[str, "torch.Tensor"],
    group: "SyncGroup",
) -> Callable[[], dict[str, int]]:
    """The transport's own speed on this plan: the executor's messages (same pairs, same
    buckets, same sizes, same posting order) as raw sends and receives of preallocated,
    already touched buffers, bucket after bucket; no packing, MAC, staging or store."""
    import torch

    from areal_fn.runtime.sync.executor import _prepare
    from areal_fn.runtime.sync.messages import _order

    me = group.rank
    steps, _, _ = _prepare(plan, me, src, live, None)
    posts = []
    for b, _, outgoing, incoming in steps:
        ms = sorted(outgoing + incoming, key=lambda m: _order(me, m))
        posts.append((b, [(m, torch.zeros(m.size, dtype=torch.uint8)) for m in ms]))

    def bare() -> dict[str, int]:
        pg, received = group.pg, 0
        for b, ops in posts:
            works = [
                pg.send([buf], group.group_rank(m.dst), b)
                if m.src == me
                else pg.recv([buf], group.group_rank(m.src), b)
                for m, buf in ops
            ]
            for w in works:
                w.wait()
            received += sum(m.payload for m, _ in ops if m.dst == me)
        return {"received": received, "overhead": 0}

    return bare


def _gather_broadcast(
    rank: int,
    train: Layout,
    infer: Layout,
    src: dict[str, "torch.Tensor"],
    live: dict[str, "torch.Tensor"],
    mesh: "DeviceMesh",
    bcast: Any,
    dtype: "torch.dtype",
) -> Callable[[], dict[str, int]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from areal_fn.runtime.engines.fsdp2_apply import materialize_local

    def gather_broadcast() -> dict[str, int]:
        received = 0
        mine = {lt.name: lt for lt in infer.local_tensors(rank - INFER[0])} if rank in INFER else {}
        for t in train.tensors:
            full = None
            if rank in TRAINER:
                local = src[t.name]
                if t.shape[0] % len(TRAINER):
                    raise RuntimeError(
                        f"{t.name}: uneven shards; DTensor.from_local needs the shape"
                    )
                full = DTensor.from_local(local, mesh, [Shard(0)], run_check=False).full_tensor()
                received += local.numel() * local.element_size()  # the other rank's half
            if rank in (0, *INFER):
                if full is None:
                    full = torch.empty(t.shape, dtype=dtype)
                dist.broadcast(full, src=0, group=bcast)
                if rank in INFER:
                    received += full.numel() * full.element_size()
                    if t.name in mine:
                        materialize_local(mine[t.name], {t.name: full}, out=live[t.name])
        return {"received": received, "overhead": 0}

    return gather_broadcast


def _timed(fn: Callable[[], dict[str, int]]) -> dict[str, Any]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    got = fn()
    dist.barrier()
    return {**got, "seconds": time.perf_counter() - t0}


def _run_schemes(
    schemes: dict[str, Callable[[], dict[str, int]]], live: dict[str, "torch.Tensor"]
) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """(timings per scheme, whether the planned results equal gather+broadcast's bitwise):
    the schemes take turns within each of ``REPEATS`` rounds, from zeroed live tensors."""
    import torch

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in schemes}
    reference: dict[str, torch.Tensor] = {}  # gather+broadcast's result (it runs first)
    equal = True
    for _ in range(REPEATS):
        for name, fn in schemes.items():
            for v in live.values():
                v.zero_()
            results[name].append(_timed(fn))
            if name == "gather_broadcast":
                reference = {k: v.clone() for k, v in live.items()}
            elif name.startswith("planned"):  # compared at once: no copy per scheme kept
                equal &= all(
                    torch.equal(v.view(torch.int16), reference[k].view(torch.int16))
                    for k, v in live.items()
                )
    return results, equal


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from areal_fn.runtime.sync.executor import SyncGroup

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    spec = small_spec()
    train = fsdp2_layout(spec, ParallelDims(dp=2))
    infer = inference_layout(spec, ParallelDims(tp=2))
    start = time.perf_counter()
    plan = plan_transfers(train, infer, src_ranks=TRAINER, dst_ranks=INFER)
    buckets = bucket(plan, BUCKET_MB << 20, version=1)
    plan_s = time.perf_counter() - start
    mixed = bucket(interleaved(plan), BUCKET_MB << 20, version=1)

    dtype = getattr(torch, spec.dtype)
    mesh = DeviceMesh("cpu", list(TRAINER), mesh_dim_names=("dp_shard",))
    bcast = dist.new_group([0, *INFER])
    src, live = _local_tensors(rank, train, infer, dtype)
    # a group per planned scheme: each keeps (or frees) its own staging memory
    groups = [SyncGroup.from_world(range(WORLD), timeout_s=300) for _ in range(4)]

    schemes: dict[str, Callable[[], dict[str, int]]] = {
        "gather_broadcast": _gather_broadcast(rank, train, infer, src, live, mesh, bcast, dtype),
        "planned": _planned(buckets, src, live, groups[0]),
        "planned_interleaved": _planned(mixed, src, live, groups[1]),
        "planned_fresh": _planned(buckets, src, live, groups[2], keep_staging=False),
        "planned_swap": _planned(buckets, src, live, groups[3], commit="swap"),
        "bare": _bare(buckets, src, live, groups[0]),
    }
    results, equal = _run_schemes(schemes, live)
    record = {
        "rank": rank,
        "results": results,
        "equal": equal,
        "plan_s": plan_s,
        "buckets": len(buckets.buckets),
        "lower_bound": transfer_lower_bound(train, infer, src_ranks=TRAINER, dst_ranks=INFER),
        "model_bytes": sum(c.numel for c in spec.tensors)
        * torch.tensor([], dtype=dtype).element_size(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def _sync_part() -> None:
    from areal_fn.runtime.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        run_torchrun(
            Path(__file__),
            ["--worker", tmp],
            nproc=WORLD,
            timeout_s=900,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        recs = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    spec = small_spec()
    gib = 1 << 30
    print(
        f"model: Qwen2.5-0.5B shape ({spec.num_layers} layers, {spec.dtype}, "
        f"{recs[0]['model_bytes'] / gib:.2f} GiB); trainer fsdp:d2 on ranks 0-1, inference "
        f"t2 on ranks 2-3; {WORLD} CPU processes, gloo; buckets of {BUCKET_MB} MiB "
        f"({recs[0]['buckets']} buckets); planning took {recs[0]['plan_s']:.2f} s"
    )
    rows = {}
    for name in (
        "gather_broadcast",
        "planned",
        "planned_interleaved",
        "planned_fresh",
        "planned_swap",
        "bare",
    ):
        moved = sum(rec["results"][name][0]["received"] for rec in recs)
        times = [max(rec["results"][name][i]["seconds"] for rec in recs) for i in range(REPEATS)]
        rows[name] = (moved, min(times), times)
    print(f"{'scheme':<22}{'bytes moved':>14}{'best time':>12}   all rounds")
    for name, (moved, best, times) in rows.items():
        rounds = ", ".join(f"{t:.2f}" for t in times)
        print(f"{name:<22}{moved / gib:>10.3f} GiB{best:>10.2f} s   {rounds}")
    gb, pl = rows["gather_broadcast"], rows["planned"]
    mx = rows["planned_interleaved"]
    print(
        f"ratio gather+broadcast / planned: bytes {gb[0] / pl[0]:.2f}x, time {gb[1] / pl[1]:.2f}x "
        f"(interleaved: {gb[1] / mx[1]:.2f}x); "
        f"planned bytes = lower bound from the layouts: {pl[0] == recs[0]['lower_bound']}; "
        f"results bitwise equal: {all(rec['equal'] for rec in recs)}"
    )
    bare = rows["bare"]

    # per round, the bare time over the planned time of the same round (the first round,
    # which makes the groups' staging memory, is left out)
    def paired(name: str) -> list[float]:
        return sorted(b / p for b, p in zip(bare[2][1:], rows[name][2][1:], strict=True))

    per_round = paired("planned")
    median, median_fresh = statistics.median(per_round), statistics.median(paired("planned_fresh"))
    print(
        f"bare send/recv (the executor's messages as raw sends and receives of preallocated "
        f"buffers, same pairs, buckets and order): {bare[0] / bare[1] / 1e9:.2f} GB/s; "
        f"planned {pl[0] / pl[1] / 1e9:.2f} GB/s = {bare[1] / pl[1]:.2f}x of it, best against "
        f"best; per round {', '.join(f'{r:.2f}' for r in per_round)}x, median {median:.2f}x "
        f"(goal >= {GOAL_OF_BARE}x on the median: "
        f"{'met' if median >= GOAL_OF_BARE else 'NOT met'}); planned with its staging handed "
        f"back after each sync (the default, keep_staging=False): "
        f"{bare[1] / rows['planned_fresh'][1]:.2f}x best against best, median "
        f"{median_fresh:.2f}x (goal: {'met' if median_fresh >= GOAL_OF_BARE else 'NOT met'})"
    )
    median_swap = statistics.median(paired("planned_swap"))
    print(
        f"planned, staging kept, committed by swapping storages (commit='swap'): "
        f"{bare[1] / rows['planned_swap'][1]:.2f}x best against best, per round "
        f"{', '.join(f'{r:.2f}' for r in paired('planned_swap'))}x, median {median_swap:.2f}x "
        f"(goal: {'met' if median_swap >= GOAL_OF_BARE else 'NOT met'})"
    )


def _planning_part() -> None:
    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.pipeline.partition import split_evenly

    spec = model_from_hf_config(json.loads(BIG.read_text()))
    t0 = time.perf_counter()
    src = megatron_layout(
        spec, ParallelDims(dp=8, pp=8, tp=4, ep=32), stages=split_evenly([1.0] * spec.num_layers, 8)
    )
    t1 = time.perf_counter()
    full = inference_layout(spec, ParallelDims(dp=8, tp=8))
    replica = inference_layout(spec, ParallelDims(tp=8))
    t2 = time.perf_counter()
    plan = plan_transfers(src, replica, src_ranks=range(256), dst_ranks=range(256, 264))
    t3 = time.perf_counter()
    bound = transfer_lower_bound(src, replica, src_ranks=range(256), dst_ranks=range(256, 264))
    print(
        f"Qwen3-235B-A22B ({len(spec.tensors)} canonical tensors): megatron d8p8t4e32 (256 ranks) "
        f"-> sglang t8 x 8 replicas ({full.world_size} ranks)"
    )
    print(f"  layouts: megatron {t1 - t0:.1f} s, inference {t2 - t1:.1f} s")
    print(
        f"  plan one replica (8 ranks): {t3 - t2:.1f} s, {len(plan.transfers)} transfers, "
        f"{plan.bytes_total / (1 << 30):.1f} GiB (lower bound from the layouts: "
        f"{bound / (1 << 30):.1f} GiB, {'equal' if bound == plan.bytes_total else 'NOT equal'})"
    )
    print(
        f"  all 8 replicas, extrapolated: {8 * (t3 - t2):.0f} s, {8 * len(plan.transfers)} transfers"
    )


def run() -> None:
    _sync_part()
    _planning_part()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker)
    else:
        run()
