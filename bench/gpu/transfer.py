"""Conversion, checkpoint and weight-sync checks with CUDA tensors (worker side).

Each moves the same bytes two ways in one process and reports GB/s of both and
their ratio, after checking the result bitwise:

- ``convert_to_cuda``: canonical bf16 tensors in host memory (as a loaded HF
  checkpoint) -> every rank's ``megatron:t2`` local tensors in device memory
  (``iter_to_megatron``, then ``copy_`` into the device tensors), against one
  host-to-device copy of the same number of bytes (a device-to-device copy is
  printed as the ceiling);
- ``checkpoint_cuda``: ``save_checkpoint`` / ``load_checkpoint`` of device tensors
  against ``torch.save`` / ``torch.load(map_location=device)`` of the same tensors;
- ``sync_local``: a colocated sync at world 1 (every transfer is the local-copy path)
  over a sync group of the running world (NCCL on a GPU), against a device copy;
- ``sync_two_process``: rank 0 holds the trainer's tensors, rank 1 the inference
  engine's; the sync runs over NCCL; rank 1 checks what arrived.
"""

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout, stages_for
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import iter_to_megatron, to_hf, to_megatron
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.strategy.allocation import ParallelDims
from bench.gpu.compare import gbps, ratio
from bench.gpu.engines import Ctx, check_spec, random_canonical
from bench.gpu.report import CheckResult

__all__ = ["TRANSFER_CHECKS", "bitwise_equal", "io_spec"]

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
BUCKET = 64 << 20
BF16 = torch.bfloat16


def io_spec(ctx: Ctx) -> ModelSpec:
    """``specs/models/<ctx.io_model>.json`` (``None``: the engine checks' model)."""
    if ctx.io_model is None:
        return check_spec(ctx)
    return model_from_hf_config(json.loads((SPECS / f"{ctx.io_model}.json").read_text()))


def bitwise_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Same names, shapes, dtypes and bytes."""
    if set(a) != set(b):
        return False
    for n in a:
        x, y = a[n].detach().cpu(), b[n].detach().cpu()
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    return True


def _best(ctx: Ctx, fn: Callable[[], object]) -> float:
    """The best of ``ctx.repeats`` timings of ``fn`` (device synchronised around it)."""
    best = float("inf")
    for _ in range(ctx.repeats):
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def convert_to_cuda(ctx: Ctx) -> CheckResult:
    spec, dims = io_spec(ctx), ParallelDims(tp=2)
    layout = megatron_layout(spec, dims, stages=stages_for(spec, dims))
    canonical = random_canonical(spec, dtype=BF16)
    dest = {
        r: {
            lt.name: torch.empty(lt.shape, dtype=BF16, device=ctx.device)
            for lt in layout.local_tensors(r)
        }
        for r in range(layout.world_size)
    }
    nbytes = sum(_nbytes(d) for d in dest.values())

    def ours() -> None:
        for r, tensors in dest.items():
            for name, t in iter_to_megatron(canonical, layout, r):
                tensors[name].copy_(t)

    host = torch.ones(nbytes, dtype=torch.uint8)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    other = torch.empty_like(flat)
    s_ours = _best(ctx, ours)
    s_h2d = _best(ctx, lambda: flat.copy_(host))
    s_d2d = _best(ctx, lambda: other.copy_(flat))
    back = to_hf({r: {n: t.cpu() for n, t in d.items()} for r, d in dest.items()}, layout)
    same = bitwise_equal(back, canonical)
    ours_gbps, h2d = gbps(nbytes, s_ours), gbps(nbytes, s_h2d)
    return CheckResult(
        name="convert_to_cuda",
        status="ok" if same else "fail",
        figures={
            "bytes": nbytes,
            "ours_gbps": ours_gbps,
            "h2d_copy_gbps": h2d,
            "d2d_copy_gbps": gbps(nbytes, s_d2d),
            "ratio_vs_h2d": ratio(ours_gbps, h2d),
            "bitwise": same,
        },
        note=f"{ctx.io_model or 'the check model'} megatron:t2, {layout.world_size} ranks",
    )


def checkpoint_cuda(ctx: Ctx) -> CheckResult:
    from areal_fn.runtime.checkpoint.api import RankState, load_checkpoint, save_checkpoint

    spec = io_spec(ctx)
    layout = fsdp2_layout(spec, ParallelDims())
    params = {
        n: t.to(ctx.device)
        for n, t in to_megatron(random_canonical(spec, dtype=BF16), layout, 0).items()
    }
    nbytes = _nbytes(params)
    root = Path(tempfile.mkdtemp(prefix="ckpt-", dir=ctx.out))
    step = iter(range(1, 1000))
    try:

        def save() -> None:
            save_checkpoint(
                root / "ours",
                layout=layout,
                states={0: RankState(params=params)},
                model=spec,
                allocation="fsdp:d1",
                step=next(step),
                keep=1,
            )

        blank = {n: torch.empty_like(t) for n, t in params.items()}
        s_save = _best(ctx, save)
        s_load = _best(
            ctx,
            lambda: load_checkpoint(
                root / "ours", layout=layout, states={0: RankState(params=blank)}
            ),
        )
        s_tsave = _best(ctx, lambda: torch.save(params, root / "torch.pt"))
        loaded: dict[str, Tensor] = {}
        s_tload = _best(
            ctx,
            lambda: loaded.update(
                torch.load(root / "torch.pt", map_location=ctx.device, weights_only=True)
            ),
        )
        same = bitwise_equal(blank, params) and bitwise_equal(loaded, params)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save_gbps, load_gbps = gbps(nbytes, s_save), gbps(nbytes, s_load)
    return CheckResult(
        name="checkpoint_cuda",
        status="ok" if same else "fail",
        figures={
            "bytes": nbytes,
            "save_gbps": save_gbps,
            "torch_save_gbps": gbps(nbytes, s_tsave),
            "load_gbps": load_gbps,
            "torch_load_gbps": gbps(nbytes, s_tload),
            "save_ratio": ratio(save_gbps, gbps(nbytes, s_tsave)),
            "load_ratio": ratio(load_gbps, gbps(nbytes, s_tload)),
            "bitwise": same,
        },
        note="fsdp:d1 on one process; files in --out, deleted after",
    )


def _world_group(members: list[int]) -> object:
    from areal_fn.runtime.sync.executor import SyncGroup

    return SyncGroup.from_world(members, timeout_s=120)


def sync_local(ctx: Ctx, *, group: object | None = None) -> CheckResult:
    spec = io_spec(ctx)
    train, infer = fsdp2_layout(spec, ParallelDims()), inference_layout(spec, ParallelDims())
    canonical = random_canonical(spec, dtype=BF16)
    src = {n: t.to(ctx.device) for n, t in to_megatron(canonical, train, 0).items()}
    live = {
        lt.name: torch.zeros(lt.shape, dtype=BF16, device=ctx.device)
        for lt in infer.local_tensors(0)
    }
    group = group if group is not None else _world_group([0])
    s_sync, reports = _timed_sync(ctx, plan_transfers(train, infer), src, live, group)
    flat = torch.empty(reports[-1].bytes_copied, dtype=torch.uint8, device=ctx.device)
    s_copy = _best(ctx, lambda: flat.clone())
    same = bitwise_equal(to_hf({0: {n: t.cpu() for n, t in live.items()}}, infer), canonical)
    nbytes = reports[-1].bytes_copied
    ours = gbps(nbytes, s_sync)
    return CheckResult(
        name="sync_local",
        status="ok" if same and reports[-1].bytes_sent == 0 else "fail",
        figures={
            "bytes_copied": nbytes,
            "bytes_sent": reports[-1].bytes_sent,
            "sync_gbps": ours,
            "device_copy_gbps": gbps(nbytes, s_copy),
            "ratio": ratio(ours, gbps(nbytes, s_copy)),
            "buckets": reports[-1].buckets,
            "bitwise": same,
        },
        note=f"backend {getattr(group, 'backend', '?')}",
    )


def _timed_sync(
    ctx: Ctx, plan: Any, src: dict[str, Any], live: dict[str, Any], group: Any
) -> tuple[float, list[Any]]:
    """Best time of executing ``plan`` (bucketed, a new version each run) and its reports."""
    from areal_fn.runtime.sync.executor import send_and_receive

    version, reports = iter(range(1, 1000)), []

    def sync() -> None:
        reports.append(
            send_and_receive(
                bucket(plan, BUCKET, version=next(version)),
                src_tensors=src,
                dst_tensors=live,
                group=group,
            )
        )  # type: ignore[arg-type]

    return _best(ctx, sync), reports


def sync_two_process(ctx: Ctx) -> CheckResult:
    spec, rank = io_spec(ctx), dist.get_rank()
    train, infer = fsdp2_layout(spec, ParallelDims()), inference_layout(spec, ParallelDims())
    canonical = random_canonical(spec, dtype=BF16)
    src = (
        {n: t.to(ctx.device) for n, t in to_megatron(canonical, train, 0).items()}
        if rank == 0
        else {}
    )
    live = (
        {
            lt.name: torch.zeros(lt.shape, dtype=BF16, device=ctx.device)
            for lt in infer.local_tensors(0)
        }
        if rank == 1
        else {}
    )
    group = _world_group([0, 1])
    plan = plan_transfers(train, infer, src_ranks=[0], dst_ranks=[1])
    seconds, reports = _timed_sync(ctx, plan, src, live, group)
    same = rank != 1 or bitwise_equal(
        to_hf({0: {n: t.cpu() for n, t in live.items()}}, infer), canonical
    )
    mine = {
        "rank": rank,
        "same": same,
        "seconds": seconds,
        "received": reports[-1].bytes_received,
        "sent": reports[-1].bytes_sent,
    }
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    recv = next(r for r in every if r["rank"] == 1)  # type: ignore[index]
    ok = all(r["same"] for r in every)  # type: ignore[index]
    nbytes, slowest = int(recv["received"]), max(float(r["seconds"]) for r in every)  # type: ignore[index]
    return CheckResult(
        name="sync_two_process",
        status="ok" if ok and nbytes > 0 else "fail",
        figures={
            "bytes": nbytes,
            "sync_gbps": gbps(nbytes, slowest),
            "bitwise": ok,
            "buckets": reports[-1].buckets,
        },
        note=f"rank 0 -> rank 1, backend {group.backend}",  # type: ignore[attr-defined]
    )


TRANSFER_CHECKS: dict[str, Callable[[Ctx], CheckResult]] = {
    "convert_to_cuda": convert_to_cuda,
    "checkpoint_cuda": checkpoint_cuda,
    "sync_local": sync_local,
    "sync_two_process": sync_two_process,
}
