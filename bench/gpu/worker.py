"""The torchrun entry of the GPU check: one process group, the named checks, one record.

``python -m torch.distributed.run --nproc-per-node N bench/gpu/worker.py --device cuda
--checks a,b --out DIR --launch NAME --budget-s S [--steps K] [--quick]``: ``cuda``
sets each rank's device to its local rank and opens an NCCL group, ``cpu`` a gloo
group. Checks run in the order given; one that would overrun the launch's budget is
skipped, one that raises is recorded with its error and the rest still run. Rank 0
writes ``DIR/<launch>.json`` (a list of check records).
"""

import argparse
import datetime
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.gpu.engines import ENGINE_CHECKS, Ctx  # noqa: E402
from bench.gpu.megatron_fp8 import PARITY_CHECKS  # noqa: E402
from bench.gpu.megatron_native import megatron_dist_optimizer  # noqa: E402
from bench.gpu.plan import skip_reason  # noqa: E402
from bench.gpu.report import CheckResult, report_json  # noqa: E402
from bench.gpu.transfer import TRANSFER_CHECKS  # noqa: E402

RUNNERS: dict[str, Callable[[Ctx], CheckResult]] = {
    **ENGINE_CHECKS,
    "megatron_dist_optimizer": megatron_dist_optimizer,
    **PARITY_CHECKS,
    **TRANSFER_CHECKS,
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--checks", required=True, help="name=budget_s,... in run order")
    p.add_argument("--out", required=True)
    p.add_argument("--launch", required=True)
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


def _run_one(name: str, budget: float, ctx: Ctx, *, elapsed: float, total: float) -> CheckResult:
    skip = skip_reason(budget, elapsed_s=elapsed, total_s=total)
    if skip:
        return CheckResult(name=name, status="skipped", budget_s=budget, note=skip)
    start = time.perf_counter()
    try:
        result = RUNNERS[name](ctx)
        note = result.note
    except Exception as e:  # recorded; the launch goes on (world 1: no peer left waiting)
        tail = traceback.format_exc().strip().splitlines()[-6:]
        result = CheckResult(name=name, status="error", note=f"{type(e).__name__}: {e}")
        note = result.note + " | " + " / ".join(x.strip() for x in tail)
    seconds = time.perf_counter() - start
    if seconds > budget:
        note = (note + "; " if note else "") + f"over its budget ({seconds:.0f} s > {budget:.0f} s)"
    return CheckResult(
        name=name,
        status=result.status,
        seconds=seconds,
        budget_s=budget,
        figures=result.figures,
        note=note,
    )


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    args = _args(argv)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    checks = [(c.split("=")[0], float(c.split("=")[1])) for c in args.checks.split(",") if c]
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300)
    )
    out = Path(args.out)
    ctx = Ctx(device=args.device, steps=args.steps, out=out, repeats=1 if args.quick else 3)
    results = []
    try:
        for name, budget in checks:
            elapsed = time.perf_counter() - start
            results.append(_run_one(name, budget, ctx, elapsed=elapsed, total=args.budget_s))
            if dist.get_rank() == 0:  # written after every check: a killed launch keeps the rest
                data = [report_json_entry(r) for r in results]
                (out / f"{args.launch}.json").write_text(json.dumps(data, indent=2))
    finally:
        dist.destroy_process_group()
    return 0


def report_json_entry(result: CheckResult) -> dict[str, object]:
    """One check record in the report's JSON form."""
    from bench.gpu.report import Report

    entry: dict[str, object] = report_json(Report(budget_s=0.0, elapsed_s=0.0, results=(result,)))[
        "checks"
    ][0]
    return entry


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
