"""The main job (``make demo`` / ``areal-fn demo``): launch the demo worker under torchrun.

The worker (:mod:`areal_fn.runtime.demo.worker`) plans, trains a tiny Qwen2-architecture
model under ``fsdp:d2t2``, trains from its weights on packed mixed-length sequences
under Ulysses SP (``fsdp:d2c2``) and checks that step against plain transformers,
checkpoints it, exports it for transformers, resumes it under ``megatron:t2p2`` and
checks the canonical weights bitwise, syncs the weights to a TP2 inference group and
checks the logits, updates a real vLLM server (TP2, started here while the job trains,
in vLLM's own Python: :func:`~areal_fn.runtime.vllm.python.vllm_python`) after each
engine and compares its generation, trains the packed phase again under context parallelism
(``megatron:d2c2``), then prints a verification table. It always runs 4 processes
(every strategy fills 4 ranks; the inference group is ranks 2-3). CPU with gloo (``AREAL_FN_BACKEND`` selects another
process-group backend; the engines are verified on CPU only).

The artefacts go to ``--workdir DIR`` (a new or empty directory): the checkpoint under
``DIR/checkpoints`` and the HF export in ``DIR/hf``. Without ``--workdir`` they go to a
new temporary directory, which is kept; either way the last lines name both.
Multi-node: run the same worker with ``torchrun --nnodes N --node-rank R --master-addr
HOST --nproc-per-node P areal_fn/runtime/demo/worker.py --workdir DIR`` (world size 4),
with the same ``AREAL_FN_SYNC_SECRET`` exported on every node (the weight sync's group
refuses to form without it; the driver's own launch generates one).
"""

import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from areal_fn.errors import SpecError
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.runtime.demo.vllm_stage import VllmServer, write_served_model
from areal_fn.runtime.launch import LaunchError, run_torchrun
from areal_fn.runtime.sync.auth import SECRET_ENV

WORKER = Path(__file__).with_name("worker.py")

#: The demo's world size (``fsdp:d2t2`` and ``megatron:t2p2`` fill it; it is not a choice).
NPROC = 4
#: The default number of training steps.
STEPS = 30
#: The fewest training steps: the demo checks that training lowers the loss by 20%,
#: which the tiny model first does at step 19 (loss 5.553 -> 4.422).
MIN_STEPS = 20
#: Where the worker writes under its work directory.
CHECKPOINTS, HF_EXPORT = "checkpoints", "hf"


def check_demo_flags(*, steps: int, workdir: "str | os.PathLike[str] | None") -> None:
    """Raise :class:`SpecError` (worded for the command line) unless the flags can run."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < MIN_STEPS:
        raise SpecError(
            f"--steps {steps} is too few: the demo checks that training lowers the loss by "
            f"20%, which takes at least {MIN_STEPS} steps; pass --steps {MIN_STEPS} or more "
            f"(the default is {STEPS})"
        )
    if workdir is None:
        return
    where = Path(workdir)
    if where.exists() and not where.is_dir():
        raise SpecError(
            f"--workdir {where} is a file; the demo writes its checkpoint and HF export into "
            "a directory: pass a new or empty directory"
        )
    held = sorted(p.name for p in where.iterdir()) if where.is_dir() else []
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise SpecError(
            f"--workdir {where} is not empty (it holds {shown}); the demo writes a new "
            "checkpoint and HF export there: pass a new or empty directory, or remove what "
            "it holds"
        )


def run_demo(
    *,
    steps: int = STEPS,
    workdir: "str | os.PathLike[str] | None" = None,
    timeout_s: float = 600.0,
    fault: str = "",
) -> int:
    """Run the demo; returns 0 when every verification passed, 1 when the job failed.

    Bad flags raise :class:`SpecError` before anything starts. ``workdir`` (a new or
    empty directory) receives the checkpoint and the HF export; ``None`` makes a new
    temporary directory, which is kept (and removed only if nothing was written).
    ``fault="RANK:STAGE"`` (``train`` or ``sync``) kills that rank there: the job must
    then fail fast with a message naming the rank (the reliability test uses it).
    """
    check_demo_flags(steps=steps, workdir=workdir)
    chosen = workdir is not None
    if workdir is not None:
        where = Path(workdir).absolute()
        where.mkdir(parents=True, exist_ok=True)
    else:
        where = Path(tempfile.mkdtemp(prefix="areal_fn_demo_"))
    # the rollout engine: a real vLLM server, started while the job trains
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)
    served = Path(tempfile.mkdtemp(prefix="areal_fn_demo_vllm_"))
    server = VllmServer(
        write_served_model(served / "model", DEMO_CONFIG),
        secret=secret,
        log=served / "server.log",
    )
    args = ["--steps", str(steps), "--workdir", str(where), "--fault", fault]
    args += ["--vllm-url", server.url, "--vllm-model", str(served / "model")]
    try:
        result = run_torchrun(
            WORKER,
            args,
            nproc=NPROC,
            timeout_s=timeout_s,
            env={SECRET_ENV: secret},
            check=False,
        )
    except LaunchError as e:
        _print_artefacts(where, chosen=chosen)
        print(f"areal-fn demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        log = (served / "server.log").read_text(errors="replace")
        shutil.rmtree(served, ignore_errors=True)
    sys.stdout.write(result.rank_stdout[0] if result.rank_stdout else result.output)
    _print_artefacts(where, chosen=chosen)
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
        print(f"the vLLM server's last output:\n{log[-3000:]}", file=sys.stderr)
        return 1
    return 0


def _latest_checkpoint(root: Path) -> Path | None:
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    return root / name if name and (root / name).is_dir() else None


def _print_artefacts(where: Path, *, chosen: bool) -> None:
    """Name the checkpoint and the HF export the run left in ``where`` (plain text)."""
    checkpoint = _latest_checkpoint(where / CHECKPOINTS)
    hf = where / HF_EXPORT
    if checkpoint is None and not hf.is_dir():
        if not chosen and not any(where.iterdir()):
            shutil.rmtree(where)
            print(f"no artefacts were written; removed {where}")
        else:
            print(f"no checkpoint or HF export was written in {where}")
        return
    note = (
        ""
        if chosen
        else " (a new temporary directory, kept: remove it when done; --workdir DIR puts "
        "the artefacts elsewhere)"
    )
    print(f"artefacts in {where}{note}:")
    if checkpoint is not None:
        print(f"  checkpoint  {checkpoint}  (areal-fn checkpoint inspect {where / CHECKPOINTS})")
    if hf.is_dir():
        print(f"  HF export   {hf}  (transformers: AutoModelForCausalLM.from_pretrained)")
