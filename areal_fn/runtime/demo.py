"""The main job (``make demo`` / ``areal-fn demo``): launch the demo worker under torchrun.

The worker (:mod:`areal_fn.runtime.demo_worker`) plans, trains a tiny Qwen2-architecture
model under ``fsdp:d2t2``, checkpoints it, resumes it under ``megatron:t2p2`` and checks
the canonical weights bitwise, syncs the weights to a TP2 inference group and checks the
logits, then prints a verification table. Gloo on CPU; NCCL when every rank has a GPU
(set ``AREAL_FN_BACKEND=nccl``). Multi-node: run the same worker with
``torchrun --nnodes N --node-rank R --master-addr HOST --nproc-per-node G -m areal_fn.runtime.demo_worker``.
"""

import sys
import tempfile
from pathlib import Path

from .launch import LaunchError, run_torchrun

WORKER = Path(__file__).with_name("demo_worker.py")


def run_demo(
    *, nproc: int = 4, steps: int = 8, timeout_s: float = 600.0, out: str | None = None
) -> int:
    """Run the demo; returns 0 when every verification passed."""
    if nproc != 4:
        print(
            f"areal-fn demo: error: the demo runs on exactly 4 processes (got --nproc {nproc})",
            file=sys.stderr,
        )
        return 2
    workdir = out or tempfile.mkdtemp(prefix="areal_fn_demo_")
    try:
        result = run_torchrun(
            WORKER,
            ["--steps", str(steps), "--workdir", workdir],
            nproc=nproc,
            timeout_s=timeout_s,
            check=False,
        )
    except LaunchError as e:
        print(f"areal-fn demo: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(result.rank_stdout[0] if result.rank_stdout else result.output)
    if not result.ok:
        print(result.report(), file=sys.stderr)
        return 1
    return 0
