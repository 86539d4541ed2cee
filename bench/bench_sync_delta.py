"""Delta weight sync against the dense sync and the dense lower bound, after real AdamW steps.

Part 1 (one process): change density. A model built from its config (random weights),
fp32 master weights, ``STEPS`` AdamW steps at each RL learning rate of ``LRS`` from the
same initial weights, a language-model loss on random tokens; after every step the
canonical tensors in bf16 are a version (:mod:`bench.delta_versions`). Printed: the
fraction of bf16 elements that changed bitwise per step, and the runs they form.
Models: the main job's tiny model (``areal_fn.model.demo``) and a Qwen2.5-0.5B-shaped
model (``specs/models/Qwen2.5-0.5B.json``) cut to ``LAYERS_05B`` layers with the same
widths (the full 24 layers' fp32 AdamW state, about 8 GB, does not fit beside the
other jobs of this 2-core machine; the embedding, 28% of the full model, is whole).

Part 2 (4 CPU processes under torchrun, gloo): trainer ``fsdp:d2`` on ranks 0-1,
inference ``t2`` on ranks 2-3, buckets of ``BUCKET_MB`` MiB, bf16. Every rank reads the
versions (memory-mapped) and takes its shards. Each step's transition is synced
``REPEATS`` times (forward, back, forward: the same mask each time) by three schemes
taking turns, each over a group of its own:

- **dense**: ``send_and_receive`` as the weight sync runs by default
  (``keep_staging=False``); it moves exactly the dense lower bound;
- **dense_kept**: the same with ``keep_staging=True`` (staging memory kept);
- **delta**: ``send_and_receive(..., delta=DeltaState())``: only the changed elements,
  each message in its smallest encoding; the receivers hold the version before and the
  sources keep what they sent.

After every round the delta receivers' tensors are checked bitwise against the dense
ones. Printed per model and learning rate: bytes on the wire (payload plus headers)
against the dense bound (``transfer_lower_bound``), best and median times against the
dense sync, the encodings used, and what the sources keep. Goal at lr 1e-6: delta
bytes at most ``GOAL_BYTES`` of the dense bound, and delta time below the dense sync's.

Run: ``.venv/bin/python -m bench sync_delta``.
"""

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.layouts.fsdp2 import fsdp2_layout  # noqa: E402
from areal_fn.layouts.inference import inference_layout  # noqa: E402
from areal_fn.model.demo import DEMO_CONFIG  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

MODEL_05B = ROOT / "specs" / "models" / "Qwen2.5-0.5B.json"
LAYERS_05B = 4
LRS = (1e-6, 1e-5)
STEPS = 3
WORLD = 4
TRAINER, INFER = (0, 1), (2, 3)
BUCKET_MB = 64
REPEATS = 3
GOAL_BYTES = 0.2
SCHEMES = ("dense", "dense_kept", "delta")


def specs() -> dict[str, ModelSpec]:
    tiny = {**DEMO_CONFIG, "torch_dtype": "bfloat16"}
    half = json.loads(MODEL_05B.read_text())
    half.update(num_hidden_layers=LAYERS_05B, max_window_layers=LAYERS_05B)
    return {
        "tiny (demo)": model_from_hf_config(tiny),
        f"Qwen2.5-0.5B shape, {LAYERS_05B} of 24 layers": model_from_hf_config(half),
    }


# ----------------------------------------------------------------------------- worker
def _shards(layout: Any, rank: int, version: dict[str, Any]) -> dict[str, Any]:
    from areal_fn.runtime.engines.fsdp2_apply import materialize_local

    return {lt.name: materialize_local(lt, version) for lt in layout.local_tensors(rank)}


def _timed(fn: Any) -> tuple[Any, float]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    got = fn()
    dist.barrier()
    return got, time.perf_counter() - t0


def _sync_all(
    ctx: dict[str, Any], version: int, src: dict[str, Any], order: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Sync ``src`` as ``version`` by every scheme in ``order``: report and time of each."""
    from areal_fn.plans.transfer import bucket
    from areal_fn.runtime.sync.executor import send_and_receive

    bp = bucket(ctx["plan"], BUCKET_MB << 20, version=version)
    out = {}
    for name in order:
        rep, seconds = _timed(
            lambda name=name: send_and_receive(
                bp,
                src_tensors=src,
                dst_tensors=ctx["live"][name],
                group=ctx["groups"][name],
                keep_staging=name == "dense_kept",
                delta=ctx["state"] if name == "delta" else None,
            )
        )
        out[name] = {
            "seconds": seconds,
            "sync_seconds": rep.seconds,
            "received": rep.bytes_received,
            "overhead": rep.overhead_bytes,
            "full": rep.bytes_full,
            "deltas": rep.delta_messages,
        }
    return out


def _equal(live: dict[str, dict[str, Any]]) -> bool:
    import torch

    return all(
        torch.equal(t.view(torch.int16), live["dense"][k].view(torch.int16))
        for k, t in live["delta"].items()
    )


def _context(rank: int, meta: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """The plan, each scheme's live tensors and group, the delta state; both layouts."""
    import torch

    from areal_fn.plans.transfer import plan_transfers
    from areal_fn.runtime.sync.executor import DeltaState, SyncGroup

    spec = model_from_hf_config(meta["config"])
    train = fsdp2_layout(spec, ParallelDims(dp=2))
    infer = inference_layout(spec, ParallelDims(tp=2))
    initial = torch.load(meta["initial"], mmap=True)
    start = _shards(infer, rank - INFER[0], initial) if rank in INFER else {}
    ctx = {
        "plan": plan_transfers(train, infer, src_ranks=TRAINER, dst_ranks=INFER),
        "live": {n: {k: v.clone() for k, v in start.items()} for n in SCHEMES},
        "groups": {
            n: SyncGroup.from_world(range(WORLD), timeout_s=300, name=f"bench_{n}") for n in SCHEMES
        },
        "state": DeltaState(),
    }
    return ctx, train, infer


def _worker(tmp: Path) -> None:
    import torch
    import torch.distributed as dist

    from areal_fn.plans.delta import delta_base_bytes
    from areal_fn.plans.transfer import bucket
    from areal_fn.plans.transfer.bound import transfer_lower_bound

    meta = json.loads((tmp / "meta.json").read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    ctx, train, infer = _context(rank, meta)

    def sources(path: str) -> dict[str, Any]:
        return _shards(train, rank, torch.load(path, mmap=True)) if rank in TRAINER else {}

    version, rounds = 0, {}
    for lr, paths in meta["after"].items():
        prev = sources(meta["initial"])
        version += 1  # every scheme's receivers hold the initial version (not timed)
        _sync_all(ctx, version, prev, SCHEMES)
        rows = []
        for i, path in enumerate(paths):
            new = sources(path)
            for r in range(REPEATS):  # forward, back, forward: the same mask each time
                version += 1
                order = SCHEMES if (i + r) % 2 == 0 else SCHEMES[::-1]
                got: dict[str, Any] = _sync_all(ctx, version, new if r % 2 == 0 else prev, order)
                got["equal"] = _equal(ctx["live"]) if rank in INFER else True
                rows.append(got)
            prev = new
        rounds[lr] = rows
    record = {
        "rank": rank,
        "rounds": rounds,
        "lower_bound": transfer_lower_bound(train, infer, src_ranks=TRAINER, dst_ranks=INFER),
        "kept_bytes": ctx["state"].kept_bytes,
        "base_bytes": delta_base_bytes(bucket(ctx["plan"], BUCKET_MB << 20), rank),
    }
    (tmp / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def _densities(name: str, spec: ModelSpec) -> tuple[Any, dict[float, list[dict[str, Any]]]]:
    from bench.delta_versions import density, train_versions

    vs = train_versions(spec, LRS, STEPS)
    out = {}
    numel = sum(c.numel for c in spec.tensors)
    print(
        f"{name}: {numel / 1e6:.1f} M parameters; fp32 AdamW, {STEPS} steps per learning rate "
        f"({vs.step_seconds:.2f} s per step); changed bf16 elements per step:"
    )
    for lr in LRS:
        steps, prev = [], vs.initial
        for v in vs.after[lr]:
            steps.append(density(prev, v))
            prev = v
        out[lr] = steps
        shown = ", ".join(f"{d['density']:.2%} ({d['runs'] / d['total']:.2%} runs)" for d in steps)
        print(f"  lr {lr:g}: {shown}")
    return vs, out


def _launch(spec: ModelSpec, vs: Any) -> list[dict[str, Any]]:
    import torch

    from areal_fn.runtime.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="bench_delta_") as tmp:
        folder = Path(tmp)
        torch.save(vs.initial, folder / "initial.pt")
        after = {}
        for lr in LRS:
            after[str(lr)] = []
            for i, v in enumerate(vs.after[lr]):
                torch.save(v, path := folder / f"lr{lr:g}_{i}.pt")
                after[str(lr)].append(str(path))
        meta = {
            "config": dict(spec.hf_config()),
            "initial": str(folder / "initial.pt"),
            "after": after,
        }
        (folder / "meta.json").write_text(json.dumps(meta))
        run_torchrun(
            Path(__file__),
            ["--worker", tmp],
            nproc=WORLD,
            timeout_s=1800,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _report(recs: list[dict[str, Any]], densities: dict[float, list[dict[str, Any]]]) -> None:
    """Per learning rate: bytes against the dense bound, times against the dense sync."""
    bound = recs[0]["lower_bound"]
    mib = 1 << 20
    kept = ", ".join(f"{r['kept_bytes'] / mib:.1f}" for r in recs[:2])
    base = ", ".join(f"{r['base_bytes'] / mib:.1f}" for r in recs[:2])
    print(
        f"  sync fsdp:d2 -> t2, {BUCKET_MB} MiB buckets, {REPEATS} rounds per step; dense "
        f"bound {bound / mib:.1f} MiB; each source keeps "
        f"{kept} MiB for deltas (delta_base_bytes: {base} MiB)"
    )
    for lr in LRS:
        rows = [rec["rounds"][str(lr)] for rec in recs]
        n = len(rows[0])
        wire = {
            s: [
                sum(
                    r[i][s]["received"] + r[i][s]["overhead"] * (k in TRAINER)
                    for k, r in enumerate(rows)
                )
                for i in range(n)
            ]
            for s in SCHEMES
        }
        times = {s: [max(r[i][s]["seconds"] for r in rows) for i in range(n)] for s in SCHEMES}
        deltas = sum(rows[k][i]["delta"]["deltas"] for k in INFER for i in range(n))
        equal = all(r[i]["equal"] for r in rows for i in range(n))
        d_bytes = statistics.median(wire["delta"]) / bound
        ratio = [d / f for d, f in zip(times["delta"], times["dense"], strict=True)]
        print(
            f"  lr {lr:g} (density {statistics.median(d['density'] for d in densities[lr]):.2%}): "
            f"wire bytes, median of rounds: dense {statistics.median(wire['dense']) / bound:.3f}x "
            f"of the bound, delta {d_bytes:.4f}x ({statistics.median(wire['delta']) / mib:.2f} MiB); "
            f"delta messages received over the rounds: {deltas}; bitwise equal to dense: {equal}"
        )
        for s in SCHEMES:
            print(
                f"    {s:<11} best {min(times[s]):.3f} s, median {statistics.median(times[s]):.3f} s"
                f"   rounds {', '.join(f'{t:.2f}' for t in times[s])}"
            )
        med = statistics.median(ratio)
        print(
            f"    delta / dense time per round: {', '.join(f'{r:.2f}' for r in ratio)}x, median "
            f"{med:.2f}x; dense_kept / delta (median): "
            f"{statistics.median(times['dense_kept']) / statistics.median(times['delta']):.2f}x"
        )
        if lr == LRS[0]:
            ok_b, ok_t = d_bytes <= GOAL_BYTES, med < 1.0
            print(
                f"    goal at lr {lr:g}: bytes <= {GOAL_BYTES}x of the bound "
                f"{'met' if ok_b else 'NOT met'}; time below the dense sync "
                f"{'met' if ok_t else 'NOT met'}"
            )


def run() -> None:
    for name, spec in specs().items():
        vs, densities = _densities(name, spec)
        _report(_launch(spec, vs), densities)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker)
    else:
        run()
