"""Weight sync into an FP8 deployment against the BF16 sync of the same model.

4 CPU processes under torchrun (gloo): a Qwen2.5-0.5B-shaped model (all 24 layers,
bf16, random values; tied embeddings), trainer ``fsdp:d2`` on ranks 0-1, inference
``t2`` on ranks 2-3 (as in ``bench sync``). Two syncs, taking turns in each of
``REPEATS`` rounds (barrier to barrier, wall time, the slowest rank; best of the rounds):

- **bf16**: :func:`~areal_fn.runtime.sync.executor.send_and_receive` of the plan from the
  FSDP2 layout to the inference layout: bf16 weights travel;
- **fp8**: :func:`~areal_fn.runtime.sync.fp8.send_and_receive_fp8` of the plan between
  their :func:`~areal_fn.plans.fp8_sync.fp8_layout` forms (128x128 blocks): the trainer
  ranks quantise their shards (``quantize_shard``, the amax of the blocks their shards
  cut all-reduced between them), then ``float8_e4m3fn`` values and float32 scales
  travel; the embedding and the norms stay bf16. Its row includes the quantisation; the
  row **fp8 quantise** is the quantisation alone (trainer ranks), **fp8 move** the
  sync of sources quantised beforehand.

Bytes are what the inference ranks receive (``SyncReport.bytes_received``), printed with
each plan's bound from the layouts (:func:`~areal_fn.plans.transfer.bound.transfer_lower_bound`).
Run: ``.venv/bin/python -m bench sync_fp8``.
"""

import argparse
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.layouts.fsdp2 import fsdp2_layout  # noqa: E402
from areal_fn.layouts.inference import inference_layout  # noqa: E402
from areal_fn.layouts.layout import Layout  # noqa: E402
from areal_fn.model.quantized import Fp8Format, scale_name  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.fp8_sync import fp8_layout, fp8_quantization  # noqa: E402
from areal_fn.plans.transfer import bucket, plan_transfers  # noqa: E402
from areal_fn.plans.transfer.bound import transfer_lower_bound  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

if TYPE_CHECKING:
    import torch

MODEL = ROOT / "specs" / "models" / "Qwen2.5-0.5B.json"
WORLD = 4
TRAINER, INFER = (0, 1), (2, 3)
BUCKET_MB = 64
REPEATS = 5
FMT = Fp8Format()


def _spec() -> ModelSpec:
    return model_from_hf_config(json.loads(MODEL.read_text()))


def _linear_bytes(buckets: Any, buckets8: Any, quant: Any) -> tuple[int, int, int]:
    """Bytes across ranks of the quantised weights in the bf16 plan, and of the same
    weights and of their scales in the FP8 plan."""
    names = {q.name for q in quant}
    scales = {scale_name(n) for n in names}

    def total(bs: Any, keep: set[str]) -> int:
        return sum(
            t.nbytes for b in bs for t in b.transfers if t.canonical in keep and not t.is_local
        )

    return total(buckets, names), total(buckets8, names), total(buckets8, scales)


def _tensors(
    rank: int, train: Layout, infer: Layout, dst8: Layout
) -> "tuple[dict[str, torch.Tensor], ...]":
    """(bf16 sources, bf16 live tensors, FP8 live tensors) of ``rank``: random trainer
    shards on the trainer ranks, zeroed inference tensors on the inference ranks."""
    import torch

    src: dict[str, torch.Tensor] = {}
    live: dict[str, torch.Tensor] = {}
    live8: dict[str, torch.Tensor] = {}
    if rank in TRAINER:
        gen = torch.Generator().manual_seed(rank)
        for lt in train.local_tensors(TRAINER.index(rank)):
            src[lt.name] = torch.empty(lt.shape, dtype=torch.bfloat16).uniform_(
                -1, 1, generator=gen
            )
    else:
        for lt in infer.local_tensors(INFER.index(rank)):
            live[lt.name] = torch.zeros(lt.shape, dtype=torch.bfloat16)
        for lt in dst8.local_tensors(INFER.index(rank)):
            live8[lt.name] = torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype))
    return src, live, live8


def _rounds(schemes: dict[str, Callable[[], int]]) -> dict[str, list[tuple[int, float]]]:
    """(bytes received, seconds) of every scheme in every round, taking turns, barrier to
    barrier."""
    import torch.distributed as dist

    results: dict[str, list[tuple[int, float]]] = {k: [] for k in schemes}
    for _ in range(REPEATS):
        for name, fn in schemes.items():
            dist.barrier()
            start = time.perf_counter()
            moved = fn()
            dist.barrier()
            results[name].append((moved, time.perf_counter() - start))
    return results


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from areal_fn.runtime.sync.executor import SyncGroup, send_and_receive
    from areal_fn.runtime.sync.fp8 import quantize_sources, send_and_receive_fp8

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    spec = _spec()
    train = fsdp2_layout(spec, ParallelDims(dp=2))
    infer = inference_layout(spec, ParallelDims(tp=2))
    src8, dst8 = fp8_layout(train, FMT), fp8_layout(infer, FMT)
    quant = fp8_quantization(train, FMT)
    plan = bucket(plan_transfers(train, infer, src_ranks=TRAINER, dst_ranks=INFER), BUCKET_MB << 20)
    plan8 = bucket(plan_transfers(src8, dst8, src_ranks=TRAINER, dst_ranks=INFER), BUCKET_MB << 20)
    trainers = dist.new_group(list(TRAINER))
    groups = [SyncGroup.from_world(range(WORLD), timeout_s=300) for _ in range(2)]
    src, live, live8 = _tensors(rank, train, infer, dst8)
    me = TRAINER.index(rank) if rank in TRAINER else None

    def bf16() -> int:
        r = send_and_receive(
            plan, src_tensors=src, dst_tensors=live, group=groups[0], keep_staging=True
        )
        return r.bytes_received

    def fp8() -> int:
        r = send_and_receive_fp8(
            plan8,
            quantization=quant,
            src_rank=me,
            src_tensors=src,
            dst_tensors=live8,
            group=groups[1],
            quant_group=trainers,
            keep_staging=True,
        )
        return r.bytes_received

    moved8 = quantize_sources(quant, me, src, group=trainers) if me is not None else {}

    def fp8_move() -> int:
        r = send_and_receive(
            plan8, src_tensors=moved8, dst_tensors=live8, group=groups[1], keep_staging=True
        )
        return r.bytes_received

    def quantise() -> int:
        if me is not None:
            quantize_sources(quant, me, src, group=trainers)
        return 0

    schemes: dict[str, Callable[[], int]] = {
        "bf16": bf16,
        "fp8": fp8,
        "fp8 move": fp8_move,
        "fp8 quantise": quantise,
    }
    record = {
        "results": _rounds(schemes),
        "bound": transfer_lower_bound(train, infer, src_ranks=TRAINER, dst_ranks=INFER),
        "bound8": transfer_lower_bound(src8, dst8, src_ranks=TRAINER, dst_ranks=INFER),
        "linear": _linear_bytes(plan.buckets, plan8.buckets, quant),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def run() -> None:
    from areal_fn.runtime.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="bench_sync_fp8_") as tmp:
        run_torchrun(
            Path(__file__),
            ["--worker", tmp],
            nproc=WORLD,
            timeout_s=900,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        recs = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    mib = 1 << 20
    print(
        f"model: Qwen2.5-0.5B shape ({_spec().num_layers} layers, bf16, tied embeddings); "
        f"trainer fsdp:d2 on ranks 0-1, inference t2 on ranks 2-3; {WORLD} CPU processes, "
        f"gloo; buckets of {BUCKET_MB} MiB; FP8: 128x128 blocks; best of {REPEATS} rounds"
    )
    rows = {}
    for name in ("bf16", "fp8", "fp8 move", "fp8 quantise"):
        moved = sum(rec["results"][name][0][0] for rec in recs)
        times = [max(rec["results"][name][i][1] for rec in recs) for i in range(REPEATS)]
        rows[name] = (moved, min(times), times)
    bounds = {"bf16": recs[0]["bound"], "fp8": recs[0]["bound8"], "fp8 move": recs[0]["bound8"]}
    print(f"{'sync':<14}{'bytes received':>18}{'bound':>14}{'best time':>12}   all rounds")
    for name, (moved, best, times) in rows.items():
        bound = f"{bounds[name] / mib:>10.1f} MiB" if name in bounds else f"{'':>14}"
        rounds = ", ".join(f"{t:.2f}" for t in times)
        print(f"{name:<14}{moved / mib:>14.1f} MiB{bound}{best:>10.2f} s   {rounds}")
    (b, tb, _), (f, tf, _) = rows["bf16"], rows["fp8"]
    print(
        f"fp8 / bf16: bytes {f / b:.3f}x, time {tf / tb:.2f}x (moving the quantised sources "
        f"alone: {rows['fp8 move'][1] / tb:.2f}x); bytes = bounds: "
        f"{b == bounds['bf16'] and f == bounds['fp8']}"
    )
    w16, w8, sc = recs[0]["linear"]
    print(
        f"of which the quantised linear weights: bf16 {w16 / mib:.1f} MiB -> fp8 {w8 / mib:.1f} "
        f"MiB + scales {sc / mib:.2f} MiB ({(w8 + sc) / w16:.3f}x); the rest (embedding, "
        f"norms, biases) travels as bf16 in both"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker)
    else:
        run()
