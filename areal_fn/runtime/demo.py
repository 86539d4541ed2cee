"""The main job (``make demo`` / ``areal-fn demo``): launch the demo worker under torchrun.

The worker (:mod:`areal_fn.runtime.demo_worker`) plans, trains a tiny Qwen2-architecture
model under ``fsdp:d2t2``, checkpoints it, resumes it under ``megatron:t2p2`` and checks
the canonical weights bitwise, syncs the weights to a TP2 inference group and checks the
logits, then prints a verification table. CPU with gloo (``AREAL_FN_BACKEND`` selects another
process-group backend; the engines are verified on CPU only). Multi-node: run the same
worker with ``torchrun --nnodes N --node-rank R --master-addr HOST --nproc-per-node P
areal_fn/runtime/demo_worker.py --workdir DIR`` (world size 4).
"""

import sys
import tempfile
from pathlib import Path

from .launch import LaunchError, run_torchrun

WORKER = Path(__file__).with_name("demo_worker.py")


def run_demo(
    *,
    nproc: int = 4,
    steps: int = 30,
    timeout_s: float = 600.0,
    out: str | None = None,
    fault: str = "",
) -> int:
    """Run the demo; returns 0 when every verification passed.

    ``fault="RANK:STAGE"`` (``train`` or ``sync``) kills that rank there: the job must
    then fail fast with a message naming the rank (the reliability test uses it).
    """
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
            ["--steps", str(steps), "--workdir", workdir, "--fault", fault],
            nproc=nproc,
            timeout_s=timeout_s,
            check=False,
        )
    except LaunchError as e:
        print(f"areal-fn demo: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(result.rank_stdout[0] if result.rank_stdout else result.output)
    if not result.ok:
        failed = [
            r
            for r, err in enumerate(result.rank_stderr)
            if "injected death" in err or "Traceback" in err
        ]
        print(
            f"areal-fn demo: error: the job failed (ranks {failed or 'unknown'}); details:",
            file=sys.stderr,
        )
        print(result.report(), file=sys.stderr)
        return 1
    return 0
