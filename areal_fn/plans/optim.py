"""The optimizer's settings, the same for every engine: AdamW hyper-parameters, the
learning-rate schedule and fp16's dynamic loss scale (pure records; the engines apply
them)."""

import math
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from areal_fn.errors import SpecError

__all__ = ["AdamWConfig", "LRSchedule", "LossScale"]


def _positive_float(_inst: object, attr: "attrs.Attribute[float]", value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise SpecError(f"AdamWConfig.{attr.name}={value!r} must be a finite number > 0")


def _non_negative(_inst: object, attr: "attrs.Attribute[float]", value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise SpecError(f"AdamWConfig.{attr.name}={value!r} must be a finite number >= 0")


def _pair(value: Iterable[float]) -> tuple[float, float]:
    out = tuple(value)
    return out  # type: ignore[return-value]  # the validator checks the length


def _betas(_inst: object, attr: "attrs.Attribute[tuple[float, float]]", value: Any) -> None:
    if not (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)
    ):
        raise SpecError(
            f"AdamWConfig.betas={value!r} must be two numbers in [0, 1), e.g. (0.9, 0.999)"
        )


def _steps(_inst: object, attr: "attrs.Attribute[int]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"LRSchedule.{attr.name}={value!r} must be an int >= 0")


def _total(_inst: object, _attr: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpecError(f"LRSchedule.total_steps={value!r} must be None (no decay) or an int >= 1")


def _ratio(_inst: object, _attr: object, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise SpecError(f"LRSchedule.min_lr_ratio={value!r} must lie in [0, 1]")


def _shape(_inst: object, _attr: object, value: str) -> None:
    if value not in ("cosine", "linear"):
        raise SpecError(
            f"LRSchedule.decay={value!r} is not a decay shape; use 'cosine' or 'linear'"
        )


@attrs.frozen(kw_only=True)
class LRSchedule:
    """Learning-rate multiplier by optimizer step: linear warm-up over ``warmup_steps``
    (step ``i`` gets ``(i + 1) / warmup_steps``), then ``decay`` from 1 down to
    ``min_lr_ratio`` at ``total_steps`` (held there after); ``total_steps=None`` keeps 1.
    The default is a constant rate. Its state is the step count alone, which the
    engines report (``scheduler_state``) for checkpoints.
    """

    warmup_steps: int = attrs.field(default=0, validator=_steps)
    total_steps: int | None = attrs.field(default=None, validator=_total)
    min_lr_ratio: float = attrs.field(default=0.0, converter=float, validator=_ratio)
    decay: str = attrs.field(default="cosine", validator=_shape)

    def __attrs_post_init__(self) -> None:
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise SpecError(
                f"LRSchedule.total_steps={self.total_steps} must exceed warmup_steps={self.warmup_steps}"
            )

    def factor(self, step: int) -> float:
        """The multiplier of the base rate at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = (
            0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        )
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@attrs.frozen(kw_only=True)
class AdamWConfig:
    """AdamW hyper-parameters, the same for every engine; ``schedule`` scales ``lr`` by step.

    The update is ``torch.optim.AdamW``'s: weight decay ``lr * weight_decay`` applied to
    every parameter (norms and biases included), then the Adam step.
    """

    lr: float = attrs.field(default=1e-3, validator=_positive_float)
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), converter=_pair, validator=_betas
    )
    eps: float = attrs.field(default=1e-8, validator=_positive_float)
    weight_decay: float = attrs.field(default=0.01, validator=_non_negative)
    schedule: LRSchedule = attrs.field(factory=LRSchedule)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        return self.lr * self.schedule.factor(step)

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Write :meth:`lr_at` into every parameter group; returns it."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def build(self, params: Any) -> torch.optim.AdamW:
        """``torch.optim.AdamW`` over ``params`` with these settings."""
        return torch.optim.AdamW(
            params,
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


def _scale_field(_inst: object, attr: "attrs.Attribute[float]", value: object) -> None:
    v = value if isinstance(value, float) and math.isfinite(value) else math.nan
    good, rule = {
        "init_scale": (v > 0, "a finite number > 0, e.g. 65536.0"),
        "growth_factor": (v > 1, "a finite number > 1, e.g. 2.0"),
        "backoff_factor": (0 < v < 1, "a number in (0, 1), e.g. 0.5"),
    }[attr.name]
    if not good:
        raise SpecError(f"LossScale.{attr.name}={value!r} must be {rule}")


def _interval(_inst: object, _attr: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"LossScale.growth_interval={value!r} must be an int >= 1, e.g. 2000")


def _as_float(value: object) -> object:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


@attrs.frozen(kw_only=True)
class LossScale:
    """fp16's dynamic loss scale, with ``torch.amp.GradScaler``'s rules and defaults.

    The loss is multiplied by the scale (``init_scale`` at first) before backward and
    the gradients divided by it before clipping and the step. A step whose gradients
    hold an inf or a NaN on any rank is skipped on every rank and the scale multiplied
    by ``backoff_factor``; after ``growth_interval`` steps in a row without one, the
    scale is multiplied by ``growth_factor``.
    """

    init_scale: float = attrs.field(default=2.0**16, converter=_as_float, validator=_scale_field)
    growth_factor: float = attrs.field(default=2.0, converter=_as_float, validator=_scale_field)
    backoff_factor: float = attrs.field(default=0.5, converter=_as_float, validator=_scale_field)
    growth_interval: int = attrs.field(default=2000, validator=_interval)
