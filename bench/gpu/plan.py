"""The checks of the GPU check, their launches and time budgets (pure data and rules).

Every check belongs to one *launch* (one ``torchrun`` start, or the driver itself) and
has a budget in seconds; the budgets of one H200 run add up to less than
``DEFAULT_BUDGET_S`` (8 minutes), so a retry fits in 15. A launch runs only when the
GPUs it needs are present and its checks' budgets fit in what is left of the total;
otherwise its checks are recorded as skipped, with the reason.
"""

from collections.abc import Sequence

import attrs

from areal_fn.typecheck import beartype
from bench.gpu.compare import GpuCheckError

__all__ = [
    "CHECKS",
    "DEFAULT_BUDGET_S",
    "LAUNCHES",
    "START_S",
    "Check",
    "Launch",
    "Planned",
    "launch_budget",
    "plan_checks",
    "render_plan",
    "select_checks",
    "skip_reason",
]

#: The whole run's budget: 8 minutes on one H200.
DEFAULT_BUDGET_S = 480.0
#: What one torchrun start costs before the first check (imports, NCCL set-up).
START_S = 25.0


@attrs.frozen(kw_only=True)
class Launch:
    """One start: ``nproc`` processes on ``backend`` (``driver``: in the driver itself)."""

    name: str
    nproc: int
    backend: str
    min_gpus: int
    what: str


LAUNCHES: tuple[Launch, ...] = (
    Launch(name="cpu", nproc=1, backend="gloo", min_gpus=1, what="the CPU fp32 reference steps"),
    Launch(name="cuda", nproc=1, backend="nccl", min_gpus=1, what="world size 1 on cuda:0"),
    Launch(name="driver", nproc=0, backend="none", min_gpus=1, what="comparisons of the launches"),
    Launch(name="cuda2", nproc=2, backend="nccl", min_gpus=2, what="two processes, one GPU each"),
    Launch(
        name="law",
        nproc=4,
        backend="gloo",
        min_gpus=4,
        what="pytest tests/distributed/test_grad_equivalence.py",
    ),
    Launch(name="demo", nproc=4, backend="gloo", min_gpus=4, what="areal-fn demo"),
)
_LAUNCH = {x.name: x for x in LAUNCHES}


@attrs.frozen(kw_only=True)
class Check:
    """One check: its launch, its budget in seconds (full run / ``--quick``), what it shows."""

    name: str
    launch: str = attrs.field()
    budget_s: float
    quick_s: float
    what: str

    @launch.validator
    def _known(self, _: object, value: str) -> None:
        if value not in _LAUNCH:
            raise GpuCheckError(
                f"check {self.name}: launch {value!r} is not one of {sorted(_LAUNCH)}"
            )


CHECKS: tuple[Check, ...] = (
    Check(
        name="cpu_reference",
        launch="cpu",
        budget_s=40,
        quick_s=30,
        what="one fp32 step of each engine on CPU (gloo): the reference",
    ),
    Check(
        name="fsdp2_bf16_train",
        launch="cuda",
        budget_s=40,
        quick_s=25,
        what="Fsdp2Engine on cuda, bf16 compute, loss falls over the steps",
    ),
    Check(
        name="fsdp2_fp32_step",
        launch="cuda",
        budget_s=15,
        quick_s=10,
        what="Fsdp2Engine on cuda: one fp32 step, weights kept for the comparison",
    ),
    Check(
        name="megatron_fp32_train",
        launch="cuda",
        budget_s=40,
        quick_s=25,
        what="MegatronEngine on cuda without CPU redirections: fp32 steps, loss falls",
    ),
    Check(
        name="logprobs_agree",
        launch="cuda",
        budget_s=20,
        quick_s=15,
        what="forward log-probs of the two engines on cuda agree",
    ),
    Check(
        name="megatron_dist_optimizer",
        launch="cuda",
        budget_s=45,
        quick_s=30,
        what="GPTModel in bf16 with get_megatron_optimizer (distributed optimizer)",
    ),
    Check(
        name="megatron_fp8_delayed",
        launch="cuda",
        budget_s=20,
        quick_s=15,
        what="Megatron-Core with TE's layer spec, fp8_recipe delayed, vs the same bf16 steps",
    ),
    Check(
        name="megatron_fp8_tensorwise",
        launch="cuda",
        budget_s=20,
        quick_s=15,
        what="the same with fp8_recipe tensorwise (current scaling)",
    ),
    Check(
        name="megatron_fp8_blockwise",
        launch="cuda",
        budget_s=20,
        quick_s=15,
        what="the same with fp8_recipe blockwise (1x128 / 128x128 blocks, Hopper)",
    ),
    Check(
        name="megatron_overlap_param_gather",
        launch="cuda",
        budget_s=20,
        quick_s=15,
        what="distributed optimizer with overlap_param_gather: the plain bf16 run's losses",
    ),
    Check(
        name="convert_to_cuda",
        launch="cuda",
        budget_s=40,
        quick_s=20,
        what="canonical -> megatron:t2 local tensors in CUDA memory, GB/s vs a device copy",
    ),
    Check(
        name="checkpoint_cuda",
        launch="cuda",
        budget_s=60,
        quick_s=30,
        what="save/load from CUDA tensors, GB/s vs torch.save/torch.load",
    ),
    Check(
        name="sync_local",
        launch="cuda",
        budget_s=25,
        quick_s=15,
        what="colocated weight sync at world 1 (the local-copy path) over an NCCL group",
    ),
    Check(
        name="fsdp2_fp32_vs_cpu",
        launch="driver",
        budget_s=5,
        quick_s=5,
        what="the cuda fp32 step equals the CPU one within 1e-5 relative (FSDP2)",
    ),
    Check(
        name="megatron_fp32_vs_cpu",
        launch="driver",
        budget_s=5,
        quick_s=5,
        what="the cuda fp32 step equals the CPU one within 1e-5 relative (Megatron)",
    ),
    Check(
        name="sync_two_process",
        launch="cuda2",
        budget_s=40,
        quick_s=30,
        what="weight sync from rank 0 to rank 1 over NCCL, GB/s",
    ),
    Check(
        name="grad_equivalence",
        launch="law",
        budget_s=120,
        quick_s=120,
        what="the gradient-equivalence law's launch (4 processes)",
    ),
    Check(name="demo", launch="demo", budget_s=120, quick_s=120, what="the demo (4 processes)"),
)
_CHECK = {c.name: c for c in CHECKS}


@beartype
def select_checks(names: Sequence[str] | None) -> tuple[Check, ...]:
    """The checks named (all when ``None``), in ``CHECKS`` order; unknown names refused.

    A comparison check needs the launches it compares: naming ``fsdp2_fp32_vs_cpu``
    brings ``cpu_reference`` and ``fsdp2_fp32_step`` along (and likewise for Megatron).
    """
    if names is None:
        return CHECKS
    unknown = sorted(set(names) - set(_CHECK))
    if unknown:
        raise GpuCheckError(f"unknown check(s) {unknown}; choose from {[c.name for c in CHECKS]}")
    if not names:
        raise GpuCheckError(f"no check named; choose from {[c.name for c in CHECKS]}")
    wanted = set(names)
    if "fsdp2_fp32_vs_cpu" in wanted:
        wanted |= {"cpu_reference", "fsdp2_fp32_step"}
    if "megatron_fp32_vs_cpu" in wanted:
        wanted |= {"cpu_reference", "megatron_fp32_train"}
    return tuple(c for c in CHECKS if c.name in wanted)


@attrs.frozen(kw_only=True)
class Planned:
    """A check with its budget for this run and why it will not run (``""``: it will)."""

    check: Check
    budget_s: float
    skip: str = ""


@beartype
def plan_checks(checks: Sequence[Check], *, gpus: int, quick: bool) -> tuple[Planned, ...]:
    """Budgets for this run (``quick`` ones with ``--quick``); checks needing more GPUs
    than ``gpus`` are marked skipped, saying how many they need."""
    out = []
    for c in checks:
        need = _LAUNCH[c.launch].min_gpus
        skip = f"needs {need} GPUs, {gpus} present" if gpus < need else ""
        out.append(Planned(check=c, budget_s=c.quick_s if quick else c.budget_s, skip=skip))
    return tuple(out)


@beartype
def launch_budget(planned: Sequence[Planned], launch: str) -> float:
    """Seconds a launch may take: its runnable checks' budgets plus one start (0 if none)."""
    mine = [p.budget_s for p in planned if p.check.launch == launch and not p.skip]
    if not mine:
        return 0.0
    return sum(mine) + (START_S if _LAUNCH[launch].nproc else 0.0)


@beartype
def skip_reason(budget_s: float, *, elapsed_s: float, total_s: float) -> str:
    """Why something of ``budget_s`` must not start ``elapsed_s`` into ``total_s`` ("" = it may)."""
    left = total_s - elapsed_s
    if budget_s > left:
        return f"budget: needs {budget_s:.0f} s, {max(left, 0.0):.0f} s of {total_s:.0f} s left"
    return ""


@beartype
def render_plan(planned: Sequence[Planned], *, total_s: float) -> str:
    """The plan as text (``--dry-run``): per launch its checks, budgets and skips."""
    lines = [f"plan (total budget {total_s:.0f} s):"]
    for launch in LAUNCHES:
        mine = [p for p in planned if p.check.launch == launch.name]
        if not mine:
            continue
        procs = f"{launch.nproc} process(es), {launch.backend}" if launch.nproc else "in the driver"
        lines.append(
            f"  {launch.name}: {launch.what} ({procs}); {launch_budget(planned, launch.name):.0f} s"
        )
        for p in mine:
            state = f"skip: {p.skip}" if p.skip else f"{p.budget_s:.0f} s"
            lines.append(f"    {p.check.name:<24} {state:<32} {p.check.what}")
    runnable = sum(launch_budget(planned, x.name) for x in LAUNCHES)
    lines.append(f"  sum of runnable budgets: {runnable:.0f} s")
    return "\n".join(lines)
