"""The GPU check's CPU-side logic (``bench/gpu``): arguments, wheel plan, report, budgets,
figures, the no-CUDA refusal, and its conversion/checkpoint/sync/engine checks on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import compare, plan, report, wheels
from bench.gpu.args import Args, PrepareArgs, parse_args
from bench.gpu.compare import GpuCheckError

REPO = Path(__file__).resolve().parents[2]
CP312: list[tuple[str, str, str]] = [
    ("cp312", "cp312", "manylinux_2_28_x86_64"),
    ("cp312", "cp312", "manylinux2014_x86_64"),
    ("py3", "none", "any"),
]


# -- arguments ------------------------------------------------------------------------
def test_arguments_parse_into_a_record(tmp_path: Path) -> None:
    a = parse_args(["--out", str(tmp_path / "o"), "--quick", "--checks", "sync_local,demo"])
    assert isinstance(a, Args)
    assert (a.out, a.quick, a.checks, a.budget_s, a.steps) == (
        tmp_path / "o",
        True,
        ("sync_local", "demo"),
        480.0,
        4,
    )
    p = parse_args(["prepare-wheels", str(tmp_path), "--print-only"])
    assert p == PrepareArgs(dest=tmp_path, print_only=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], r"--out is required"),
        (["--out", "FILE"], r"--out .* is a file; give a directory"),
        (["--out", "o", "--wheels", "nowhere"], r"--wheels nowhere is not a directory"),
        (["--out", "o", "--budget-s", "0"], r"--budget-s 0 must lie in \(0, 600\]"),
        (["--out", "o", "--budget-s", "700"], r"--budget-s 700 must lie in \(0, 600\]"),
        (["--out", "o", "--steps", "1"], r"--steps 1 must be >= 2"),
        (["--out", "o", "--checks", "sync_local,nope"], r"unknown check\(s\) \['nope'\]"),
        (["--out", "o", "--checks", ","], r"no check named"),
    ],
)
def test_bad_arguments_are_refused(argv: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("FILE", "o", "nowhere") else a for a in argv]
    with pytest.raises(GpuCheckError, match=message.replace("nowhere", ".*nowhere")):
        parse_args(argv)


# -- wheels ---------------------------------------------------------------------------
def test_wheel_names_parse_per_pep_427() -> None:
    w = wheels.parse_wheel_name(
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    )
    assert (w.dist, w.version) == ("megatron-core", "0.16.1")
    assert w.tags == {
        ("cp312", "cp312", "manylinux_2_24_x86_64"),
        ("cp312", "cp312", "manylinux_2_28_x86_64"),
    }
    with pytest.raises(GpuCheckError, match=r"'beartype.whl' is not a wheel file name"):
        wheels.parse_wheel_name("beartype.whl")


def _fake_wheels(folder: Path, names: list[str]) -> list[str]:
    for n in names:
        (folder / n).write_bytes(b"")
    return sorted(p.name for p in folder.iterdir())


def test_the_plan_picks_the_newest_wheel_that_suits_this_python(tmp_path: Path) -> None:
    files = _fake_wheels(
        tmp_path,
        [
            "beartype-0.22.0-py3-none-any.whl",
            "beartype-0.23.1-py3-none-any.whl",
            "megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl",
            "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
            "README.txt",
        ],
    )
    p = wheels.install_plan(
        ["beartype", "megatron_core"], files, supported=CP312, wheel_dir=str(tmp_path), python="py"
    )
    assert p.installs == (
        ("beartype", "beartype-0.23.1-py3-none-any.whl"),
        ("megatron-core", "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"),
    )
    assert p.command == (
        "py",
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(tmp_path),
        "--no-deps",
        f"{tmp_path}/beartype-0.23.1-py3-none-any.whl",
        f"{tmp_path}/megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
    )
    assert (
        wheels.install_plan([], files, supported=CP312, wheel_dir=None, python="py").command is None
    )


def test_the_plan_refuses_when_a_needed_wheel_is_missing(tmp_path: Path) -> None:
    files = _fake_wheels(tmp_path, ["megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl"])
    with pytest.raises(
        GpuCheckError,
        match=r"no installable wheel for: megatron-core \(megatron_core-0.16.1-cp311.*tags do not "
        r"suit this Python\)\), areal-fn \(no wheel of it\); run `python -m bench.gpu prepare-wheels",
    ):
        wheels.install_plan(
            ["megatron-core", "areal-fn"],
            files,
            supported=CP312,
            wheel_dir=str(tmp_path),
            python="py",
        )
    with pytest.raises(GpuCheckError, match=r"beartype not importable and no --wheels DIR given"):
        wheels.install_plan(["beartype"], [], supported=CP312, wheel_dir=None, python="py")


def test_prepare_commands_target_python_312_x86_64() -> None:
    build, download = wheels.prepare_commands(
        "W", versions={"megatron-core": "0.16.1", "beartype": "0.23.1"}, python="py"
    )
    assert build == ("py", "-m", "pip", "wheel", ".", "--no-deps", "-w", "W")
    assert download == (
        "py",
        "-m",
        "pip",
        "download",
        "megatron-core==0.16.1",
        "beartype==0.23.1",
        "--python-version",
        "3.12",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux2014_x86_64",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--only-binary=:all:",
        "--no-deps",
        "-d",
        "W",
    )
    with pytest.raises(GpuCheckError, match=r"no installed version of \['megatron-core'\] to pin"):
        wheels.prepare_commands("W", versions={"beartype": "1"}, python="py")


def test_this_interpreter_suits_its_own_tags() -> None:
    tag = wheels.supported_tags()[0]
    name = f"beartype-9.9-{tag[0]}-{tag[1]}-{tag[2]}.whl"
    p = wheels.install_plan(
        ["beartype"], [name], supported=wheels.supported_tags(), wheel_dir="d", python="py"
    )
    assert p.installs == (("beartype", name),)
    assert wheels.importable("torch") and not wheels.importable("no_such_module_xyz")


# -- report ---------------------------------------------------------------------------
def _report() -> report.Report:
    return report.Report(
        versions={"torch": "2.11", "gpus": 1},
        budget_s=480.0,
        elapsed_s=12.5,
        results=(
            report.CheckResult(
                name="a",
                status="ok",
                seconds=1.0,
                budget_s=10,
                figures={"gbps": 3.5, "bitwise": True},
            ),
            report.CheckResult(name="b", status="skipped", budget_s=5, note="budget"),
        ),
    )


def test_report_json_keys_are_stable_and_round_trip(tmp_path: Path) -> None:
    path = report.write_report(_report(), tmp_path / "out")
    data = json.loads(path.read_text())
    assert path.name == "report.json"
    assert sorted(data) == ["budget_s", "checks", "elapsed_s", "ok", "schema", "versions"]
    assert data["schema"] == "areal_fn.gpu_check/1" and data["ok"] is True
    assert sorted(data["checks"][0]) == ["budget_s", "figures", "name", "note", "seconds", "status"]
    assert data["checks"][0]["figures"] == {"bitwise": True, "gbps": 3.5}
    assert [report.result_from_json(c) for c in data["checks"]] == list(_report().results)
    with pytest.raises(GpuCheckError, match=r"lacks \['status'\]"):
        report.result_from_json({"name": "x"})


def test_the_table_lists_every_check_and_the_verdict() -> None:
    text = report.render_table(_report())
    assert "versions: gpus 1, torch 2.11" in text
    assert "a      ok       1.0 / 10    bitwise=True, gbps=3.5" in text
    assert "b      skipped  0.0 / 5     budget" in text
    assert text.endswith("all checks passed: 1 ok, 0 failed, 1 skipped; 12.5 s of a 480 s budget")
    failed = report.Report(
        budget_s=1, elapsed_s=0, results=(report.CheckResult(name="c", status="fail"),)
    )
    assert not failed.ok and "SOME CHECKS FAILED" in report.render_table(failed)
    with pytest.raises(GpuCheckError, match=r"status='bad' is not one of"):
        report.CheckResult(name="c", status="bad")


# -- plan and budgets -----------------------------------------------------------------
def test_one_gpu_plan_fits_eight_minutes_and_skips_multi_gpu_checks() -> None:
    planned = plan.plan_checks(plan.CHECKS, gpus=1, quick=False)
    total = sum(plan.launch_budget(planned, x.name) for x in plan.LAUNCHES)
    assert total <= plan.DEFAULT_BUDGET_S
    skipped = {p.check.name: p.skip for p in planned if p.skip}
    assert skipped == {
        "sync_two_process": "needs 2 GPUs, 1 present",
        "grad_equivalence": "needs 4 GPUs, 1 present",
        "demo": "needs 4 GPUs, 1 present",
    }
    assert plan.launch_budget(planned, "cuda2") == 0.0
    assert plan.launch_budget(planned, "cpu") == 40 + plan.START_S
    assert all(p.skip for p in plan.plan_checks(plan.CHECKS, gpus=0, quick=True))


def test_budget_skips_what_would_overrun() -> None:
    assert plan.skip_reason(60.0, elapsed_s=400.0, total_s=480.0) == ""
    assert (
        plan.skip_reason(90.0, elapsed_s=400.0, total_s=480.0)
        == "budget: needs 90 s, 80 s of 480 s left"
    )
    assert (
        plan.skip_reason(1.0, elapsed_s=500.0, total_s=480.0)
        == "budget: needs 1 s, 0 s of 480 s left"
    )


def test_comparisons_bring_the_checks_they_compare() -> None:
    names = [c.name for c in plan.select_checks(["megatron_fp32_vs_cpu"])]
    assert names == ["cpu_reference", "megatron_fp32_train", "megatron_fp32_vs_cpu"]
    assert "sync_local" in plan.render_plan(
        plan.plan_checks(plan.CHECKS, gpus=1, quick=True), total_s=480.0
    )


# -- figures --------------------------------------------------------------------------
def test_relative_difference_and_throughput_arithmetic() -> None:
    ref = {"w": torch.tensor([2.0, -4.0]), "z": torch.zeros(2)}
    got = {"w": torch.tensor([2.0, -3.0]), "z": torch.tensor([0.0, 0.5])}
    assert compare.max_rel_diff(ref, got) == 0.5  # z: all-zero reference -> absolute 0.5; w: 1/4
    assert compare.max_rel_diff({"w": ref["w"]}, {"w": got["w"]}) == 0.25
    assert compare.max_rel_diff(ref, got, where={"z": torch.tensor([True, False])}) == 0.25
    with pytest.raises(GpuCheckError, match=r"only in the first \['z'\], only in the second \[\]"):
        compare.max_rel_diff(ref, {"w": got["w"]})
    with pytest.raises(
        GpuCheckError, match=r"w has shape \(2,\) in the first state dict and \(3,\)"
    ):
        compare.max_rel_diff({"w": ref["w"]}, {"w": torch.zeros(3)})
    assert compare.gbps(3_000_000_000, 1.5) == 2.0
    assert compare.ratio(2.0, 4.0) == 0.5
    with pytest.raises(GpuCheckError, match=r"seconds=0.0 must be > 0"):
        compare.gbps(1, 0.0)
    assert compare.loss_fell([3.0, 2.0]) and not compare.loss_fell([2.0, 2.0])
    assert not compare.loss_fell([3.0, float("nan")])
    with pytest.raises(GpuCheckError, match=r"1 loss\(es\) given"):
        compare.loss_fell([1.0])


def test_step_difference_judges_weights_where_gradients_are_conditioned() -> None:
    ref = {
        "loss": 2.0,
        "grad_norm": 1.0,
        "grads": {"w": torch.tensor([1.0, 1e-9])},
        "weights": {"w": torch.tensor([1.0, 1.0])},
    }
    other = {
        "loss": 2.0 * (1 + 1e-7),
        "grad_norm": 1.0,
        "grads": {"w": torch.tensor([1.0, 0.0])},
        "weights": {"w": torch.tensor([1.0, 0.999])},
    }
    d = compare.step_difference(ref, other)
    assert d["loss_rel"] == pytest.approx(1e-7)
    assert d["grads_rel"] == pytest.approx(1e-9)
    assert d["weights_rel"] == 0.0 and d["weights_rel_all"] == pytest.approx(1e-3, rel=1e-4)
    with pytest.raises(GpuCheckError, match=r"a saved step lacks \['grad_norm'\]"):
        compare.step_difference(ref, {k: v for k, v in other.items() if k != "grad_norm"})


# -- the command on a machine without CUDA ----------------------------------------------
def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_the_run_refuses_and_dry_run_prints_the_plan(tmp_path: Path) -> None:
    run = _cli("--out", str(tmp_path / "o"))
    assert run.returncode == 3, run.stderr
    assert "bench.gpu: error: no CUDA device present" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "o").exists()
    dry = _cli("--out", str(tmp_path / "o"), "--dry-run", "--quick")
    assert dry.returncode == 0, dry.stderr
    assert "plan (total budget 480 s):" in dry.stdout and "sum of runnable budgets" in dry.stdout
    bad = _cli("--out", str(tmp_path / "o"), "--budget-s", "-1")
    assert bad.returncode == 2 and "must lie in (0, 600]" in bad.stderr
    prep = _cli("prepare-wheels", str(tmp_path / "w"), "--print-only")
    assert prep.returncode == 0 and "pip download megatron-core==" in prep.stdout
    assert not (tmp_path / "w").exists()


def test_the_wrapper_script_runs_the_module() -> None:
    text = (REPO / "tools" / "gpu_check.sh").read_text()
    assert "-m bench.gpu" in text and text.startswith("#!/usr/bin/env bash")


# -- the checks themselves, on CPU tensors ------------------------------------------------
def _ctx(tmp_path: Path) -> "object":
    from bench.gpu.engines import Ctx

    return Ctx(device="cpu", steps=2, out=tmp_path, io_model=None, repeats=1)


def test_conversion_checkpoint_and_sync_checks_run_on_cpu(tmp_path: Path) -> None:
    import torch.distributed as dist

    from areal_fn.runtime.sync.executor import SyncGroup
    from bench.gpu import transfer

    ctx = _ctx(tmp_path)
    group = SyncGroup.from_store(dist.HashStore(), members=[0], rank=0)
    results = [
        transfer.convert_to_cuda(ctx),  # type: ignore[arg-type]
        transfer.checkpoint_cuda(ctx),  # type: ignore[arg-type]
        transfer.sync_local(ctx, group=group),  # type: ignore[arg-type]
    ]
    for r in results:
        assert r.status == "ok", r
        assert r.figure_map["bitwise"] is True
    sync = results[2].figure_map
    assert sync["bytes_sent"] == 0 and sync["bytes_copied"] > 0  # colocated: local copies only
    assert list(tmp_path.iterdir()) == []  # the checkpoint files are deleted


def test_the_megatron_engine_refuses_an_unknown_device() -> None:
    from areal_fn.errors import LayoutError
    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.engines.megatron import MegatronEngine
    from areal_fn.strategy.allocation import ParallelDims
    from bench.gpu.engines import CHECK_CONFIG

    with pytest.raises(LayoutError, match=r"device_type='tpu' is not 'cpu' or 'cuda'"):
        MegatronEngine(model_from_hf_config(CHECK_CONFIG), ParallelDims(), device_type="tpu")


@pytest.mark.dist
@pytest.mark.slow
def test_the_engine_checks_run_on_cpu_and_the_engines_agree(tmp_path: Path) -> None:
    """One CPU launch of the worker: every engine check passes, and the saved fp32 steps of
    the two engines (FSDP2 and Megatron-Core, from the same weights) agree as the law says."""
    from areal_fn.runtime.launch import run_torchrun
    from bench.gpu.engines import fp32_file

    checks = "cpu_reference=200,fsdp2_bf16_train=200,megatron_fp32_train=200,logprobs_agree=200"
    run_torchrun(
        REPO / "bench" / "gpu" / "worker.py",
        [
            "--device",
            "cpu",
            "--checks",
            checks,
            "--out",
            str(tmp_path),
            "--launch",
            "cpu",
            "--budget-s",
            "800",
            "--steps",
            "3",
            "--quick",
        ],
        nproc=1,
        timeout_s=400,
        env={"PYTHONPATH": str(REPO)},
    )
    records = {r["name"]: r for r in json.loads((tmp_path / "cpu.json").read_text())}
    assert {n: r["status"] for n, r in records.items()} == dict.fromkeys(records, "ok")
    assert list(records) == checks.replace("=200", "").split(",")
    load = lambda e: torch.load(fp32_file(tmp_path, e, "cpu"), weights_only=True)  # noqa: E731
    diff = compare.step_difference(load("fsdp2"), load("megatron"))
    assert max(v for k, v in diff.items() if k != "weights_rel_all") < compare.STEP_TOL, diff
