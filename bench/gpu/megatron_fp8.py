"""What ``MegatronEngine`` refuses on CPU, run by Megatron-Core on CUDA: Transformer
Engine's FP8 recipes and ``overlap_param_gather`` with the distributed optimizer.

Each check trains the same ``GPTModel`` (:data:`~bench.gpu.engines.CHECK_CONFIG`, bf16
parameters, ``DistributedDataParallel(use_distributed_optimizer=True)`` and
``get_megatron_optimizer``, as :mod:`bench.gpu.megatron_native`) from the same weights on
the same batch, against the plain bf16 run of that model:

- ``megatron_fp8_delayed`` / ``_tensorwise`` / ``_blockwise``: Transformer Engine's layer
  spec with ``fp8="hybrid"`` and Megatron-Core's ``fp8_recipe`` (delayed scaling, current
  per-tensor scaling, 1x128 / 128x128 blocks); the baseline is the same TE model without
  FP8. The first step's loss must lie within :data:`FP8_LOSS_RTOL` of the baseline's
  (the weights are equal; only the FP8 casts differ) and the loss must fall.
- ``megatron_overlap_param_gather``: the local layer spec with ``overlap_grad_reduce``
  and ``overlap_param_gather`` (the parameter all-gather started by the optimizer step
  and waited for by forward pre-hooks); every step's loss must equal the baseline's
  within :data:`OVERLAP_LOSS_RTOL`. At world size 1 the gathers are over one rank: the
  check shows the path builds and steps on CUDA, not the overlap's speed.

Each is skipped with the reason where it cannot run (:func:`fp8_skip_reason`,
:func:`overlap_skip_reason`): no CUDA, Transformer Engine not installed or too old for
the recipe, a GPU without FP8 (compute capability below 8.9; blockwise: Hopper, 9.x).
"""

import importlib.metadata
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.gpu.compare import loss_fell
from bench.gpu.engines import TRAIN, Ctx, check_batch, check_spec
from bench.gpu.report import CheckResult

__all__ = [
    "FP8_CHECKS",
    "FP8_LOSS_RTOL",
    "OVERLAP_LOSS_RTOL",
    "PARITY_CHECKS",
    "fp8_skip_reason",
    "fp8_verdict",
    "overlap_skip_reason",
    "overlap_verdict",
]

#: check name -> Megatron-Core ``fp8_recipe``.
FP8_CHECKS: dict[str, str] = {
    "megatron_fp8_delayed": "delayed",
    "megatron_fp8_tensorwise": "tensorwise",
    "megatron_fp8_blockwise": "blockwise",
}
#: The first FP8 step's loss against the bf16 one, relative (e4m3 keeps 3 mantissa bits).
FP8_LOSS_RTOL = 0.05
#: Every loss with ``overlap_param_gather`` against the plain run, relative.
OVERLAP_LOSS_RTOL = 1e-6
#: The Transformer Engine version each recipe needs in Megatron-Core 0.16, and the GPUs.
_TE_MIN = {"delayed": (1, 0), "tensorwise": (2, 2), "blockwise": (2, 3)}
_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0)}


def _version(text: str) -> tuple[int, int]:
    parts = (text.split("+")[0].split(".") + ["0"])[:2]
    return int("".join(c for c in parts[0] if c.isdigit()) or 0), int(
        "".join(c for c in parts[1] if c.isdigit()) or 0
    )


def fp8_skip_reason(
    recipe: str, *, device: str, te: str | None, capability: tuple[int, int] | None
) -> str:
    """Why the ``recipe`` check cannot run ("" when it can): ``te`` is Transformer
    Engine's version (None: not installed), ``capability`` the GPU's (major, minor)."""
    if device != "cuda":
        return "CUDA only: Transformer Engine's FP8 GEMMs need an FP8 GPU"
    if te is None:
        return (
            "Transformer Engine is not installed (pip install transformer-engine[pytorch]); "
            "Megatron-Core's FP8 needs its layer spec"
        )
    need = _TE_MIN[recipe]
    if _version(te) < need:
        return f"fp8_recipe {recipe!r} needs Transformer Engine >= {need[0]}.{need[1]}, found {te}"
    low = _MIN_CAPABILITY[recipe]
    if capability is None or capability < low or (recipe == "blockwise" and capability[0] != 9):
        what = "Hopper (9.x)" if recipe == "blockwise" else f">= {low[0]}.{low[1]} (Ada, Hopper)"
        found = "none" if capability is None else f"{capability[0]}.{capability[1]}"
        return f"fp8_recipe {recipe!r} needs a GPU of compute capability {what}, found {found}"
    return ""


def overlap_skip_reason(*, device: str) -> str:
    """Why the ``overlap_param_gather`` check cannot run ("" when it can)."""
    if device != "cuda":
        return (
            "CUDA only: overlap_param_gather's buffers allocate on cuda and the distributed "
            "optimizer does not run on CPU"
        )
    return ""


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def fp8_verdict(bf16: Sequence[float], fp8: Sequence[float]) -> tuple[str, str]:
    """(status, note): the first FP8 loss within :data:`FP8_LOSS_RTOL` of the bf16 one
    and the FP8 loss falling."""
    problems = []
    if _rel(fp8[0], bf16[0]) > FP8_LOSS_RTOL:
        problems.append(
            f"first loss {fp8[0]:.6g} differs from bf16's {bf16[0]:.6g} by more than "
            f"{FP8_LOSS_RTOL:g} relative"
        )
    if not loss_fell(list(fp8)):
        problems.append("the FP8 loss did not fall")
    return ("fail", "; ".join(problems)) if problems else ("ok", "")


def overlap_verdict(plain: Sequence[float], overlap: Sequence[float]) -> tuple[str, str]:
    """(status, note): every step's loss within :data:`OVERLAP_LOSS_RTOL` of the plain run."""
    worst = max(_rel(a, b) for a, b in zip(overlap, plain, strict=True))
    if worst > OVERLAP_LOSS_RTOL:
        return "fail", f"a loss differs from the plain run's by {worst:.3g} relative"
    return "ok", ""


# -- CUDA only ----------------------------------------------------------------------------
def _build(ctx: Ctx, *, te: bool, overrides: dict[str, Any]) -> tuple[list[Any], Any]:
    """(GPTModel chunks on the device, their config): bf16, the TE or the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    from areal_fn.runtime.megatron import build as mb

    spec = check_spec(ctx)
    arch = mb.arch_of(spec)
    config = mb.transformer_config(
        arch,
        mb.MegatronSizes(),
        params_dtype=torch.bfloat16,
        overrides={"calculate_per_token_loss": True, **overrides},
    )
    if not te:
        return [c.to(ctx.device) for c in mb.build_model_chunks(arch, config)], config
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
    )
    return [model.to(ctx.device)], config


def _train(
    ctx: Ctx, chunks: list[Any], config: Any, weights: dict[str, Any], *, overlap: bool
) -> list[float]:
    """``ctx.steps`` steps from ``weights`` under the distributed optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from bench.gpu.megatron_native import _step

    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            p.copy_(weights[name])
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        use_distributed_optimizer=True,
    )
    model = [DistributedDataParallel(config, ddp, c) for c in chunks]
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = OptimizerConfig(
        optimizer="adam",
        lr=TRAIN.lr,
        weight_decay=TRAIN.weight_decay,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
        overlap_param_gather=overlap,
    )
    optimizer = get_megatron_optimizer(opt, model, use_gloo_process_groups=False)
    ids = check_batch(check_spec(ctx))
    return [_step(model, optimizer, ids, ctx.device)[0] for _ in range(ctx.steps)]


def _compare(
    ctx: Ctx, *, te: bool, overrides: dict[str, Any], overlap: bool
) -> tuple[list[float], list[float], float]:
    """(baseline losses, losses with the option, seconds of the latter): the same
    weights (the baseline model's initialisation) and batch."""
    from areal_fn.runtime.megatron import build as mb

    with mb.megatron_session(mb.MegatronSizes(), seed=0, cpu=False):
        chunks, config = _build(ctx, te=te, overrides={})
        weights = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
        base = _train(ctx, chunks, config, weights, overlap=False)
        chunks, config = _build(ctx, te=te, overrides=overrides)
        torch.cuda.synchronize()
        start = time.perf_counter()
        other = _train(ctx, chunks, config, weights, overlap=overlap)
        torch.cuda.synchronize()
    return base, other, time.perf_counter() - start


def _te_version() -> str | None:
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _fp8_check(name: str, recipe: str) -> Callable[[Ctx], CheckResult]:
    def run(ctx: Ctx) -> CheckResult:
        cuda = ctx.device == "cuda" and torch.cuda.is_available()
        skip = fp8_skip_reason(
            recipe,
            device=ctx.device,
            te=_te_version(),
            capability=torch.cuda.get_device_capability() if cuda else None,
        )
        if skip:
            return CheckResult(name=name, status="skipped", note=skip)
        fp8 = {"fp8": "hybrid", "fp8_recipe": recipe}
        bf16, losses, seconds = _compare(ctx, te=True, overrides=fp8, overlap=False)
        status, note = fp8_verdict(bf16, losses)
        figures: dict[str, object] = {
            "recipe": recipe,
            "loss_first_bf16": bf16[0],
            "loss_first_fp8": losses[0],
            "loss_last_bf16": bf16[-1],
            "loss_last_fp8": losses[-1],
            "steps": len(losses),
            "s_per_step_fp8": seconds / len(losses),
        }
        return CheckResult(name=name, status=status, figures=figures, note=note)

    return run


def megatron_overlap_param_gather(ctx: Ctx) -> CheckResult:
    name = "megatron_overlap_param_gather"
    if skip := overlap_skip_reason(device=ctx.device):
        return CheckResult(name=name, status="skipped", note=skip)
    plain, losses, seconds = _compare(ctx, te=False, overrides={}, overlap=True)
    status, note = overlap_verdict(plain, losses)
    worst = max(_rel(a, b) for a, b in zip(losses, plain, strict=True))
    figures: dict[str, object] = {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "max_rel_loss_diff": worst,
        "steps": len(losses),
        "s_per_step": seconds / len(losses),
    }
    if status == "ok" and not loss_fell(losses):
        status, note = "fail", "the loss did not fall"
    return CheckResult(name=name, status=status, figures=figures, note=note)


#: The checks of this module by name (the worker's runners).
PARITY_CHECKS: dict[str, Callable[[Ctx], CheckResult]] = {
    **{name: _fp8_check(name, recipe) for name, recipe in FP8_CHECKS.items()},
    "megatron_overlap_param_gather": megatron_overlap_param_gather,
}
