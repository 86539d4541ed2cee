"""The GPU check's command line, parsed into a frozen record before anything runs.

::

    python -m bench.gpu --out DIR [--wheels DIR] [--quick] [--dry-run]
                        [--checks a,b] [--budget-s 480] [--steps N]
    python -m bench.gpu prepare-wheels DIR [--print-only]

Bad arguments exit with status 2 and one line that names the flag, the value, the
rule and the remedy.
"""

import argparse
from collections.abc import Sequence
from pathlib import Path

import attrs

from areal_fn.typecheck import beartype
from bench.gpu.compare import GpuCheckError
from bench.gpu.plan import DEFAULT_BUDGET_S, select_checks

__all__ = ["MAX_BUDGET_S", "Args", "PrepareArgs", "parse_args"]

#: The longest a run may be given: one command on the lent machine runs at most 10 minutes.
MAX_BUDGET_S = 600.0
#: Training steps of the engine checks (``--quick``: ``QUICK_STEPS``).
STEPS, QUICK_STEPS = 8, 4


@attrs.frozen(kw_only=True)
class Args:
    """A run: where the report goes, the wheel folder, the checks, the budget."""

    out: Path
    wheels: Path | None
    quick: bool
    dry_run: bool
    checks: tuple[str, ...] | None
    budget_s: float
    steps: int


@attrs.frozen(kw_only=True)
class PrepareArgs:
    """``prepare-wheels``: the destination folder; ``print_only`` prints the pip lines."""

    dest: Path
    print_only: bool


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description="Check the engines, conversion, checkpoints and weight sync on CUDA/NCCL.",
    )
    p.add_argument("--out", help="directory for report.json and the launches' records")
    p.add_argument("--wheels", help="folder of wheels to install what is missing (no registry)")
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller tensors")
    p.add_argument("--dry-run", action="store_true", help="print the plan and budgets, run nothing")
    p.add_argument("--checks", help="comma-separated check names (default: all)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="total seconds")
    p.add_argument("--steps", type=int, default=None, help="training steps per engine check")
    return p


def _prepare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu prepare-wheels",
        description="Build this package's wheel and download megatron-core and beartype "
        "wheels for Python 3.12 x86_64 into DEST.",
    )
    p.add_argument("dest")
    p.add_argument("--print-only", action="store_true", help="print the pip lines, run nothing")
    return p


@beartype
def parse_args(argv: Sequence[str]) -> Args | PrepareArgs:
    """Parse ``argv``; ``GpuCheckError`` for a value argparse cannot judge (argparse's
    own errors exit with status 2)."""
    if argv and argv[0] == "prepare-wheels":
        ns = _prepare_parser().parse_args(list(argv[1:]))
        return PrepareArgs(dest=Path(ns.dest), print_only=ns.print_only)
    ns = _parser().parse_args(list(argv))
    if ns.out is None:
        raise GpuCheckError("--out is required: a directory for report.json (created if missing)")
    out = Path(ns.out)
    if out.exists() and not out.is_dir():
        raise GpuCheckError(f"--out {out} is a file; give a directory (created if missing)")
    wheels = Path(ns.wheels) if ns.wheels else None
    if wheels is not None and not wheels.is_dir():
        raise GpuCheckError(
            f"--wheels {wheels} is not a directory; give the folder "
            "`python -m bench.gpu prepare-wheels DIR` filled"
        )
    if not 0 < ns.budget_s <= MAX_BUDGET_S:
        raise GpuCheckError(
            f"--budget-s {ns.budget_s:g} must lie in (0, {MAX_BUDGET_S:g}]: one command on the "
            f"GPU machine runs at most {MAX_BUDGET_S:g} s; the default is {DEFAULT_BUDGET_S:g}"
        )
    steps = ns.steps if ns.steps is not None else (QUICK_STEPS if ns.quick else STEPS)
    if steps < 2:
        raise GpuCheckError(f"--steps {steps} must be >= 2: a falling loss needs two steps")
    checks = None
    if ns.checks is not None:
        checks = tuple(c.strip() for c in ns.checks.split(",") if c.strip())
        select_checks(checks)  # unknown names fail here, before anything runs
    return Args(
        out=out,
        wheels=wheels,
        quick=ns.quick,
        dry_run=ns.dry_run,
        checks=checks,
        budget_s=float(ns.budget_s),
        steps=steps,
    )
