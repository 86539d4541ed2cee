"""The delta planner's own cost at scale (issue #34 item 5), beside the rank plans it
works from.

For Qwen3-235B-A22B (Megatron ``d8p8t4e32`` -> SGLang ``t8`` x 8), DeepSeek-V3
(``d8p8t8e64`` -> ``t8`` x 8) and gpt-oss-120b (``d8p4t2e16`` -> ``t8`` x 8; strided
experts), the layouts of ``bench sync_plan``:

- **plan**: ``plan_rank_transfers`` for source rank 0, then ``bucket`` at 512 MiB:
  the rows a delta sync sends from (a dense sync's own cost, for scale);
- **base**: ``delta_base_bytes`` of that bucketed plan (what source rank 0 keeps
  between syncs to compute its masks), its CPU time and the bytes it says;
- **encode**: the per-message work a delta adds on the source, ``encode_changes``
  (change mask, encoding choice, the encoded payload) of a 64 MiB bf16 message against
  its previous version with 3% of its elements changed at random (the change density
  ``bench sync_delta`` measures after AdamW steps at lr 1e-6: 2.3-4.2%), as seconds per
  GiB; times source rank 0's bytes per sync, the seconds a delta sync adds to it on one
  core.

Times are CPU seconds of this process (``time.process_time``), best of ``REPEATS``.
Run: ``.venv/bin/python -m bench delta_plan``.
"""

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.plans.delta import delta_base_bytes, encode_changes  # noqa: E402
from areal_fn.plans.transfer import bucket, plan_rank_transfers  # noqa: E402
from bench.bench_sync_plan import CASES, INFER, STRIDED, _layouts  # noqa: E402

REPEATS = 2
BUCKET = 512 << 20
MESSAGE = 64 << 20
DENSITY = 0.03
GIB = 1 << 30


def _cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(REPEATS):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def encode_seconds_per_gib() -> tuple[float, float]:
    """(CPU seconds per GiB of ``encode_changes``, encoded bytes / dense bytes)."""
    gen = torch.Generator().manual_seed(0)
    n = MESSAGE // 2
    old = torch.randn(n, generator=gen).to(torch.bfloat16)
    new = old.clone()
    idx = torch.randperm(n, generator=gen)[: int(DENSITY * n)]
    new[idx] = (new[idx].float() + 1.0).to(torch.bfloat16)
    o, w = old.view(torch.uint8), new.view(torch.uint8)
    s, (_, payload, _, _) = _cpu(lambda: encode_changes(o, w, 2))
    return s * GIB / MESSAGE, payload.numel() / MESSAGE


def _case(name: str, label: str, dims: Any, per_gib: float) -> None:
    src, dst, _ = _layouts(name, dims)
    n_src = src.world_size
    sr, dr = range(n_src), range(n_src, n_src + dst.world_size)
    plan_s, plan = _cpu(lambda: plan_rank_transfers(src, dst, 0, src_ranks=sr, dst_ranks=dr))
    bucket_s, buckets = _cpu(lambda: bucket(plan, BUCKET))
    base_s, base = _cpu(lambda: delta_base_bytes(buckets, 0))
    sent = plan.send_bytes().get(0, 0)
    print(
        f"{name}: megatron {label} ({n_src} ranks) -> sglang t{INFER.tp} x {INFER.dp}; "
        f"source rank 0 sends {sent / GIB:.2f} GiB in {len(plan.transfers)} transfers, "
        f"{len(buckets.buckets)} buckets of <= {BUCKET >> 20} MiB"
    )
    print(
        f"  plan: rank plan {plan_s:.2f} s + bucket {bucket_s:.3f} s; delta base: "
        f"{base_s:.4f} s ({base_s / max(plan_s + bucket_s, 1e-9):.3f}x the plan), keeps "
        f"{base / GIB:.2f} GiB ({base / max(sent, 1):.4f}x the bytes sent)"
    )
    print(
        f"  encode: {per_gib * sent / GIB:.1f} s of one core per sync for its "
        f"{sent / GIB:.2f} GiB ({per_gib:.2f} s/GiB)"
    )


def run() -> None:
    per_gib, ratio = encode_seconds_per_gib()
    print(
        f"encode_changes, {MESSAGE >> 20} MiB bf16 message, {DENSITY:.0%} changed: "
        f"{per_gib:.2f} CPU s/GiB, encoded {ratio:.3f}x the dense bytes"
    )
    for name, label, dims in (*CASES, STRIDED):
        _case(name, label, dims, per_gib)


if __name__ == "__main__":
    run()
