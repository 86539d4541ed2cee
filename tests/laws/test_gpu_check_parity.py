"""The GPU check's Megatron-Core checks of what the CPU refuses (``bench/gpu/megatron_fp8``):
Transformer Engine's FP8 recipes and ``overlap_param_gather``. What runs here: their
place in the plan and the worker, the arguments naming them, the skip reasons, the
verdicts against the plain bf16 run, and each check skipping on CPU with its reason."""

from pathlib import Path

import pytest

from bench.gpu import megatron_fp8 as mf
from bench.gpu import plan
from bench.gpu.args import parse_args
from bench.gpu.engines import Ctx

NAMES = (
    "megatron_fp8_delayed",
    "megatron_fp8_tensorwise",
    "megatron_fp8_blockwise",
    "megatron_overlap_param_gather",
)
NO_TE = (
    "Transformer Engine is not installed (pip install transformer-engine[pytorch]); "
    "Megatron-Core's FP8 needs its layer spec"
)


def test_the_checks_run_at_world_size_1_on_cuda_and_the_worker_knows_them(
    tmp_path: Path,
) -> None:
    from bench.gpu.worker import RUNNERS

    launches = {c.name: c.launch for c in plan.CHECKS}
    assert {n: launches[n] for n in NAMES} == dict.fromkeys(NAMES, "cuda")
    assert set(NAMES) <= set(RUNNERS)
    assert tuple(mf.FP8_CHECKS) + ("megatron_overlap_param_gather",) == NAMES
    planned = plan.plan_checks(plan.CHECKS, gpus=1, quick=False)
    assert sum(plan.launch_budget(planned, x.name) for x in plan.LAUNCHES) <= 480
    a = parse_args(["--out", str(tmp_path / "o"), "--checks", ",".join(NAMES)])
    assert a.checks == NAMES
    assert [c.name for c in plan.select_checks(a.checks)] == list(NAMES)


@pytest.mark.parametrize(
    ("recipe", "device", "te", "capability", "reason"),
    [
        (
            "delayed",
            "cpu",
            "2.8.0",
            None,
            "CUDA only: Transformer Engine's FP8 GEMMs need an FP8 GPU",
        ),
        ("delayed", "cuda", None, (9, 0), NO_TE),
        ("delayed", "cuda", "2.8.0", (9, 0), ""),
        ("delayed", "cuda", "1.13.0", (8, 9), ""),
        (
            "delayed",
            "cuda",
            "2.8.0",
            (8, 0),
            "fp8_recipe 'delayed' needs a GPU of compute capability >= 8.9 (Ada, Hopper), "
            "found 8.0",
        ),
        (
            "tensorwise",
            "cuda",
            "2.1.0",
            (9, 0),
            "fp8_recipe 'tensorwise' needs Transformer Engine >= 2.2, found 2.1.0",
        ),
        ("tensorwise", "cuda", "2.2.0", (10, 0), ""),
        (
            "blockwise",
            "cuda",
            "2.3.0.dev0+abc",
            (10, 0),
            "fp8_recipe 'blockwise' needs a GPU of compute capability Hopper (9.x), found 10.0",
        ),
        (
            "blockwise",
            "cuda",
            "2.2.1",
            (9, 0),
            "fp8_recipe 'blockwise' needs Transformer Engine >= 2.3, found 2.2.1",
        ),
        ("blockwise", "cuda", "2.3.0.dev0+abc", (9, 0), ""),
    ],
)
def test_fp8_skip_reasons(
    recipe: str, device: str, te: str | None, capability: tuple[int, int] | None, reason: str
) -> None:
    assert mf.fp8_skip_reason(recipe, device=device, te=te, capability=capability) == reason


def test_overlap_runs_on_cuda_only() -> None:
    assert mf.overlap_skip_reason(device="cuda") == ""
    assert mf.overlap_skip_reason(device="cpu").startswith("CUDA only: overlap_param_gather")


@pytest.mark.parametrize("name", NAMES)
def test_on_cpu_each_check_is_skipped_with_its_reason(name: str, tmp_path: Path) -> None:
    result = mf.PARITY_CHECKS[name](Ctx(device="cpu", steps=2, out=tmp_path))
    assert result.status == "skipped" and result.name == name
    assert result.note.startswith("CUDA only: ")
    assert list(tmp_path.iterdir()) == []


def test_the_verdicts_compare_with_the_plain_bf16_run() -> None:
    bf16 = [6.93, 6.5, 6.1, 5.8]
    assert mf.fp8_verdict(bf16, [6.95, 6.52, 6.2, 5.9]) == ("ok", "")
    status, note = mf.fp8_verdict(bf16, [7.5, 7.0, 6.5, 6.0])
    assert status == "fail" and note.startswith("first loss 7.5 differs from bf16's 6.93 by more")
    assert mf.fp8_verdict(bf16, [6.93, 6.95, 7.0, 7.1]) == ("fail", "the FP8 loss did not fall")
    assert mf.overlap_verdict(bf16, list(bf16)) == ("ok", "")
    status, note = mf.overlap_verdict(bf16, [6.93, 6.5, 6.1, 5.81])
    assert status == "fail" and note == "a loss differs from the plain run's by 0.00172 relative"
