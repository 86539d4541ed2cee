"""``python -m bench.gpu``: plan, install, launch, compare, report.

Order: parse the arguments (bad ones exit 2 before anything runs); ``prepare-wheels``
prints (and runs) the pip lines and stops; ``--dry-run`` prints the wheel plan and the
plan of checks with their budgets and stops; without a CUDA device the run refuses
(exit 3) with what torch says; then the wheels missing here are installed from
``--wheels`` (exit 4 if pip fails), the versions printed, the launches run in
``LAUNCHES`` order within the budget, and the report printed and written to
``OUT/report.json``. Exit 0 when no check failed, else 1.
"""

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from areal_fn.errors import SpecError
from bench.gpu.args import Args, PrepareArgs, parse_args
from bench.gpu.compare import STEP_TOL, step_difference
from bench.gpu.engines import fp32_file
from bench.gpu.plan import (
    LAUNCHES,
    Planned,
    launch_budget,
    plan_checks,
    render_plan,
    select_checks,
    skip_reason,
)
from bench.gpu.report import CheckResult, Report, render_table, result_from_json, write_report
from bench.gpu.versions import cuda_gpus, no_cuda_message, versions
from bench.gpu.wheels import (
    REQUIRED,
    importable,
    install_plan,
    installed_versions,
    prepare_commands,
    supported_tags,
)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
LAW = REPO / "tests" / "distributed" / "test_grad_equivalence.py"
EXIT_USAGE, EXIT_NO_CUDA, EXIT_INSTALL = 2, 3, 4


def _wheel_plan(args: Args) -> object:
    missing = [r.dist for r in REQUIRED if not importable(r.module)]
    files = sorted(p.name for p in args.wheels.iterdir()) if args.wheels else []
    return install_plan(
        missing,
        files,
        supported=supported_tags(),
        wheel_dir=str(args.wheels) if args.wheels else None,
        python=sys.executable,
    )


def _prepare(args: PrepareArgs) -> int:
    commands = prepare_commands(
        str(args.dest), versions=installed_versions(), python=sys.executable, source=str(REPO)
    )
    for c in commands:
        print(" ".join(c), flush=True)
        if not args.print_only and subprocess.run(c, check=False).returncode:
            print(f"bench.gpu: error: {c[3]} failed; see pip's output above", file=sys.stderr)
            return EXIT_INSTALL
    return 0


def _skipped(planned: Sequence[Planned], reason: str) -> list[CheckResult]:
    return [
        CheckResult(name=p.check.name, status="skipped", budget_s=p.budget_s, note=p.skip or reason)
        for p in planned
    ]


def _worker_launch(
    launch: str, planned: Sequence[Planned], args: Args, budget: float
) -> list[CheckResult]:
    from areal_fn.runtime.launch import run_torchrun

    spec = next(x for x in LAUNCHES if x.name == launch)
    todo = ",".join(f"{p.check.name}={p.budget_s:g}" for p in planned)
    argv = [
        "--device",
        "cpu" if launch == "cpu" else "cuda",
        "--checks",
        todo,
        "--out",
        str(args.out),
        "--launch",
        launch,
        "--budget-s",
        f"{budget:g}",
        "--steps",
        str(args.steps),
    ]
    record = args.out / f"{launch}.json"
    record.unlink(missing_ok=True)
    env = {"PYTHONPATH": str(REPO), **({"CUDA_VISIBLE_DEVICES": ""} if launch == "cpu" else {})}
    result = run_torchrun(
        WORKER,
        [*argv, *(["--quick"] if args.quick else [])],
        nproc=spec.nproc,
        timeout_s=budget + 30,
        env=env,
        check=False,
    )
    got = {
        r["name"]: result_from_json(r)
        for r in (json.loads(record.read_text()) if record.exists() else [])
    }
    tail = (result.rank_stderr[0] if result.rank_stderr else result.output)[-300:].replace(
        "\n", " / "
    )
    why = "timed out" if result.timed_out else f"exit code {result.returncode}"
    return [
        got.get(p.check.name)
        or CheckResult(
            name=p.check.name,
            status="error",
            budget_s=p.budget_s,
            note=f"launch {launch} {why} before it: {tail}",
        )
        for p in planned
    ]


def _compare(p: Planned, args: Args) -> CheckResult:
    engine = "fsdp2" if p.check.name.startswith("fsdp2") else "megatron"
    ref, got = fp32_file(args.out, engine, "cpu"), fp32_file(args.out, engine, "cuda")
    if not (ref.exists() and got.exists()):
        return CheckResult(
            name=p.check.name,
            status="skipped",
            budget_s=p.budget_s,
            note=f"needs {ref.name} and {got.name} (their checks did not finish)",
        )
    diff = step_difference(torch.load(ref, weights_only=True), torch.load(got, weights_only=True))
    ok = all(v < STEP_TOL for k, v in diff.items() if k != "weights_rel_all")
    return CheckResult(
        name=p.check.name,
        status="ok" if ok else "fail",
        budget_s=p.budget_s,
        figures={**diff, "tolerance": STEP_TOL},
    )


def _subprocess_check(p: Planned, command: list[str], note: str) -> CheckResult:
    start = time.perf_counter()
    try:
        rc = subprocess.run(
            command, cwd=REPO, check=False, timeout=p.budget_s, capture_output=True, text=True
        )
        status, tail = ("ok" if rc.returncode == 0 else "fail"), (rc.stdout + rc.stderr)[-200:]
    except subprocess.TimeoutExpired:
        status, tail = "error", f"timed out after {p.budget_s:.0f} s"
    return CheckResult(
        name=p.check.name,
        status=status,
        seconds=time.perf_counter() - start,
        budget_s=p.budget_s,
        note=f"{note}; {' '.join(command[1:4])}: {tail.strip()[-160:]}",
    )


def _run_launch(
    launch: str, planned: Sequence[Planned], args: Args, budget: float
) -> list[CheckResult]:
    if launch in ("cpu", "cuda", "cuda2"):
        return _worker_launch(launch, planned, args, budget)
    if launch == "driver":
        return [_compare(p, args) for p in planned]
    cpu_note = "4 CPU processes on gloo (the worker builds its engines on CPU)"
    if launch == "law":
        if not importable("pytest"):
            return _skipped(planned, "pytest is not installed here")
        return [
            _subprocess_check(
                planned[0],
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(LAW)],
                cpu_note,
            )
        ]
    demo = [sys.executable, "-m", "areal_fn.cli", "demo", "--workdir", str(args.out / "demo")]
    return [_subprocess_check(planned[0], demo, cpu_note)]


def _run(args: Args, planned: Sequence[Planned], start: float) -> Report:
    results: list[CheckResult] = []
    for launch in LAUNCHES:
        mine = [p for p in planned if p.check.launch == launch.name]
        runnable = [p for p in mine if not p.skip]
        if not runnable:
            results += _skipped(mine, "")
            continue
        budget = launch_budget(planned, launch.name)
        why = skip_reason(budget, elapsed_s=time.perf_counter() - start, total_s=args.budget_s)
        results += _skipped([p for p in mine if p.skip], "")
        results += (
            _skipped(runnable, why) if why else _run_launch(launch.name, runnable, args, budget)
        )
        print(f"-- launch {launch.name}: {time.perf_counter() - start:.0f} s so far", flush=True)
    return Report(
        versions=versions(),
        budget_s=args.budget_s,
        elapsed_s=time.perf_counter() - start,
        results=tuple(results),
    )


def main(argv: Sequence[str]) -> int:
    start = time.perf_counter()
    try:
        args = parse_args(argv)
        if isinstance(args, PrepareArgs):
            return _prepare(args)
        gpus = cuda_gpus()
        planned = plan_checks(
            select_checks(args.checks),
            gpus=max(gpus, 1) if args.dry_run else gpus,
            quick=args.quick,
        )
        if args.dry_run:
            print(f"GPUs present: {gpus} (planned for {max(gpus, 1)})")
            print(_wheel_plan(args))
            print(render_plan(planned, total_s=args.budget_s))
            return 0
        if gpus == 0:
            print(f"bench.gpu: error: {no_cuda_message()}", file=sys.stderr)
            return EXIT_NO_CUDA
        plan = _wheel_plan(args)
    except SpecError as e:
        print(f"bench.gpu: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(plan, flush=True)
    command = getattr(plan, "command", None)
    if command and subprocess.run(command, check=False).returncode:
        print(
            "bench.gpu: error: installing the wheels failed; see pip's output above",
            file=sys.stderr,
        )
        return EXIT_INSTALL
    print("versions:", versions(), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = _run(args, planned, start)
    print(render_table(report))
    print(f"report: {write_report(report, args.out)}")
    return 0 if report.ok else 1
