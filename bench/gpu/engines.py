"""Engine checks (run inside a worker, world size 1): both engines on ``ctx.device``.

- ``fsdp2_bf16_train``: :class:`Fsdp2Engine` with bf16 compute (fp32 master weights
  and reductions) trains ``steps`` steps on one fixed batch; the loss must fall.
- ``fsdp2_fp32_step`` / the Megatron fp32 steps: one fp32 step from the same weights,
  its loss, gradient norm, canonical gradients and weights saved to
  ``<out>/<engine>_fp32_<device>.pt``; the driver compares the CUDA file with the CPU
  one (:func:`bench.gpu.compare.max_rel_diff`).
- ``megatron_fp32_train``: :class:`MegatronEngine` with ``device_type`` (on CUDA no CPU
  redirections) trains ``steps`` fp32 steps; the loss must fall.
- ``logprobs_agree``: ``forward_logprobs`` of the two engines from the same weights.

The model is :data:`CHECK_CONFIG`, a small Qwen2-shaped model (random weights).
"""

import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from torch import Tensor

from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import to_hf
from areal_fn.runtime.engines.common import AdamWConfig
from areal_fn.strategy.allocation import ParallelDims
from bench.gpu.compare import loss_fell, max_abs_diff
from bench.gpu.report import CheckResult

__all__ = [
    "CHECK_CONFIG",
    "ENGINE_CHECKS",
    "Ctx",
    "check_batch",
    "check_spec",
    "fp32_file",
    "random_canonical",
]

#: A small Qwen2-shaped model: 4 layers, GQA (8 query / 2 KV heads), qkv bias, untied.
CHECK_CONFIG: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
BATCH, SEQ = 8, 64
TRAIN = AdamWConfig(lr=1e-3, weight_decay=0.01)
#: The compared fp32 step: a small rate keeps AdamW's first step well conditioned
#: (``lr * g / (|g| + eps)`` turns rounding of near-zero gradients into weight changes).
COMPARE = AdamWConfig(lr=1e-5, weight_decay=0.01)
LOGPROB_TOL = 1e-4


@attrs.frozen(kw_only=True)
class Ctx:
    """Where a worker's checks run: device (``cpu``/``cuda``), steps, output, model."""

    device: str
    steps: int
    out: Path
    config: tuple[tuple[str, object], ...] = tuple(CHECK_CONFIG.items())
    #: The model of the conversion, checkpoint and sync checks: a file of
    #: ``specs/models`` (``None``: ``config``, as the CPU tests use).
    io_model: str | None = "Qwen2.5-0.5B"
    repeats: int = 3


def check_spec(ctx: Ctx) -> ModelSpec:
    return model_from_hf_config(dict(ctx.config))


def random_canonical(
    spec: ModelSpec, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Seeded canonical weights on CPU: matrices ~ N(0, 1/fan_in), norms 1, biases ~ N(0, 0.02^2)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec.tensors:
        if len(t.shape) >= 2:
            w = torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5
        elif "norm" in t.name:
            w = torch.ones(t.shape)
        else:  # biases: small, not zero (a zero tensor has no scale to compare against)
            w = 0.02 * torch.randn(t.shape, generator=gen)
        out[t.name] = w.to(dtype)
    return out


def check_batch(spec: ModelSpec) -> Tensor:
    return torch.randint(
        0, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )


def fp32_file(out: Path, engine: str, device: str) -> Path:
    """Where the fp32 step of ``engine`` (``fsdp2``/``megatron``) on ``device`` is kept."""
    return out / f"{engine}_fp32_{device}.pt"


def _fsdp2(ctx: Ctx, optimizer: AdamWConfig, *, bf16: bool = False) -> object:
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions

    run = (
        Fsdp2RunOptions(param_dtype="bfloat16", reduce_dtype="float32")
        if bf16
        else Fsdp2RunOptions()
    )
    return Fsdp2Engine(
        check_spec(ctx),
        ParallelDims(),
        run_options=run,
        optimizer=optimizer,
        device_type=ctx.device,
    )


def _megatron(ctx: Ctx, optimizer: AdamWConfig) -> object:
    from areal_fn.runtime.engines.megatron import MegatronEngine

    return MegatronEngine(
        check_spec(ctx), ParallelDims(), optimizer=optimizer, device_type=ctx.device
    )


def _sync(ctx: Ctx) -> None:
    if ctx.device == "cuda":
        torch.cuda.synchronize()


def _train(ctx: Ctx, engine: object, ids: Tensor) -> tuple[list[float], float]:
    """``ctx.steps`` steps on ``ids``: the losses and the seconds per step after the first."""
    losses, start = [], 0.0
    for i in range(ctx.steps):
        if i == 1:
            _sync(ctx)
            start = time.perf_counter()
        losses.append(float(engine.train_step(ids)["loss"]))  # type: ignore[attr-defined]
    _sync(ctx)
    return losses, (time.perf_counter() - start) / max(ctx.steps - 1, 1)


def _keep_fp32_step(ctx: Ctx, engine: object, name: str, stats: dict[str, float]) -> Path:
    """Save the step's loss, norm, canonical gradients and weights (CPU tensors)."""
    layout = engine.layout  # type: ignore[attr-defined]
    grads = {n: g.detach().cpu() for n, g in engine.local_grads().items() if g is not None}  # type: ignore[attr-defined]
    record = {
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "grads": to_hf({0: grads}, layout),
        "weights": engine.export_canonical(),  # type: ignore[attr-defined]
    }
    path = fp32_file(ctx.out, name, ctx.device)
    torch.save(record, path)
    return path


def _trained(name: str, losses: list[float], per_step: float) -> CheckResult:
    tokens = BATCH * (SEQ - 1)
    return CheckResult(
        name=name,
        status="ok" if loss_fell(losses) else "fail",
        figures={
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "steps": len(losses),
            "s_per_step": per_step,
            "tokens_per_s": tokens / per_step if per_step > 0 else 0.0,
        },
        note="" if loss_fell(losses) else "the loss did not fall",
    )


def fsdp2_bf16_train(ctx: Ctx) -> CheckResult:
    engine = _fsdp2(ctx, TRAIN, bf16=True)
    engine.load_canonical(random_canonical(check_spec(ctx)))  # type: ignore[attr-defined]
    losses, per_step = _train(ctx, engine, check_batch(check_spec(ctx)))
    return _trained("fsdp2_bf16_train", losses, per_step)


def fsdp2_fp32_step(ctx: Ctx) -> CheckResult:
    engine = _fsdp2(ctx, COMPARE)
    engine.load_canonical(random_canonical(check_spec(ctx)))  # type: ignore[attr-defined]
    stats = engine.train_step(check_batch(check_spec(ctx)))  # type: ignore[attr-defined]
    path = _keep_fp32_step(ctx, engine, "fsdp2", stats)
    return CheckResult(
        name="fsdp2_fp32_step", status="ok", figures={"loss": stats["loss"]}, note=path.name
    )


def megatron_fp32_train(ctx: Ctx) -> CheckResult:
    """The compared fp32 step (``COMPARE``), then training steps (``TRAIN``) on the same engine."""
    spec = check_spec(ctx)
    with _megatron(ctx, COMPARE) as engine:  # type: ignore[attr-defined]
        engine.load_canonical(random_canonical(spec))
        ids = check_batch(spec)
        stats = engine.train_step(ids)
        _keep_fp32_step(ctx, engine, "megatron", stats)
        if ctx.steps < 2:
            return CheckResult(
                name="megatron_fp32_train", status="ok", figures={"loss": stats["loss"]}
            )
        engine.load_canonical(random_canonical(spec))
        engine.optimizer_config = TRAIN
        losses, per_step = _train(ctx, engine, ids)
    return _trained("megatron_fp32_train", losses, per_step)


def logprobs_agree(ctx: Ctx) -> CheckResult:
    spec = check_spec(ctx)
    weights, ids = random_canonical(spec), check_batch(spec)
    fsdp = _fsdp2(ctx, TRAIN)
    fsdp.load_canonical(weights)  # type: ignore[attr-defined]
    a = fsdp.forward_logprobs(ids)  # type: ignore[attr-defined]
    with _megatron(ctx, TRAIN) as engine:  # type: ignore[attr-defined]
        engine.load_canonical(weights)
        b = engine.forward_logprobs(ids)
    diff = max_abs_diff(a, b)
    return CheckResult(
        name="logprobs_agree",
        status="ok" if diff < LOGPROB_TOL else "fail",
        figures={"max_abs_diff": diff, "tolerance": LOGPROB_TOL, "mean_logprob": float(a.mean())},
    )


def cpu_reference(ctx: Ctx) -> CheckResult:
    """Both fp32 steps on the CPU: the files the driver compares the CUDA ones with."""
    fsdp = fsdp2_fp32_step(ctx)
    mega = megatron_fp32_train(attrs.evolve(ctx, steps=1))
    return CheckResult(
        name="cpu_reference",
        status="ok",
        figures={"fsdp2_loss": fsdp.figure_map["loss"], "megatron_loss": mega.figure_map["loss"]},
    )


ENGINE_CHECKS: dict[str, Callable[[Ctx], CheckResult]] = {
    "cpu_reference": cpu_reference,
    "fsdp2_bf16_train": fsdp2_bf16_train,
    "fsdp2_fp32_step": fsdp2_fp32_step,
    "megatron_fp32_train": megatron_fp32_train,
    "logprobs_agree": logprobs_agree,
}
