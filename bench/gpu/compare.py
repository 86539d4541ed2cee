"""Pure figures of the GPU check: relative differences, GB/s, whether a loss fell.

No device, process group or clock here: the checks measure, these functions turn
measurements into the figures of the report (and are tested on CPU tensors).
"""

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from areal_fn.errors import SpecError
from areal_fn.typecheck import beartype

__all__ = ["GpuCheckError", "gbps", "loss_fell", "max_abs_diff", "max_rel_diff", "ratio"]


class GpuCheckError(SpecError):
    """An input of the GPU check breaks a rule (arguments, wheels, measurements)."""


def _same_keys(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> None:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        raise GpuCheckError(
            f"the two state dicts hold different tensors: only in the first {only_a[:5]}, "
            f"only in the second {only_b[:5]}; compare states of the same model and layout"
        )
    shapes = [n for n in sorted(a) if tuple(a[n].shape) != tuple(b[n].shape)]
    if shapes:
        n = shapes[0]
        raise GpuCheckError(
            f"{n} has shape {tuple(a[n].shape)} in the first state dict and "
            f"{tuple(b[n].shape)} in the second; compare states of the same layout"
        )


@beartype
def max_rel_diff(
    reference: Mapping[str, Tensor],
    other: Mapping[str, Tensor],
    *,
    where: Mapping[str, Tensor] | None = None,
) -> float:
    """The largest ``max|ref - other| / max|ref|`` over the tensors (float64, on CPU).

    The scale is the whole reference tensor's; ``where`` (name -> boolean mask of the
    tensor's shape) limits the differences to the masked elements. A tensor whose
    reference is all zero counts its absolute difference. Both dicts must hold the
    same names and shapes (``GpuCheckError`` otherwise); an empty pair gives 0.
    """
    _same_keys(reference, other)
    worst = 0.0
    for name in sorted(reference):
        ref = reference[name].detach().to("cpu", torch.float64)
        got = other[name].detach().to("cpu", torch.float64)
        if ref.numel() == 0:
            continue
        scale = float(ref.abs().max())
        delta = (ref - got).abs()
        if where is not None and name in where:
            delta = delta[where[name].to("cpu")]
        diff = float(delta.max()) if delta.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


@beartype
def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """``max|a - b|`` in float64 on CPU (shapes must agree)."""
    if tuple(a.shape) != tuple(b.shape):
        raise GpuCheckError(
            f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ; compare tensors of one shape"
        )
    if a.numel() == 0:
        return 0.0
    return float(
        (a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)).abs().max()
    )


@beartype
def gbps(nbytes: int, seconds: float) -> float:
    """Gigabytes (1e9 bytes) per second; ``seconds`` must be > 0 and ``nbytes`` >= 0."""
    if nbytes < 0:
        raise GpuCheckError(f"nbytes={nbytes} must be >= 0 (a byte count)")
    if not seconds > 0:
        raise GpuCheckError(
            f"seconds={seconds} must be > 0; time at least one operation (synchronise the "
            "device before reading the clock)"
        )
    return nbytes / seconds / 1e9


@beartype
def ratio(ours: float, baseline: float) -> float:
    """``ours / baseline`` (a throughput ratio: > 1 means ours is faster)."""
    if not baseline > 0:
        raise GpuCheckError(f"baseline={baseline} must be > 0 to form a ratio")
    return ours / baseline


@beartype
def loss_fell(losses: Sequence[float]) -> bool:
    """Whether the last loss is below the first (at least two finite losses)."""
    if len(losses) < 2:
        raise GpuCheckError(f"{len(losses)} loss(es) given; a trend needs at least 2 steps")
    if not all(x == x and abs(x) != float("inf") for x in losses):
        return False
    return losses[-1] < losses[0]


#: The bound of the CUDA-vs-CPU fp32 step comparison (relative).
STEP_TOL = 1e-5
#: Weights are compared where the reference gradient is at least this large: AdamW's
#: first step is ``lr * g / (|g| + eps)``, so a gradient near ``eps`` (or one that is
#: zero in exact arithmetic, as a key bias's is) turns rounding into a step of up to
#: ``lr``. The gradient-equivalence law uses the same bound.
CONDITIONED = 1e-6


@beartype
def step_difference(
    reference: Mapping[str, object], other: Mapping[str, object]
) -> dict[str, float]:
    """Relative differences of two saved fp32 steps (``loss``, ``grad_norm``, ``grads``,
    ``weights``): the scalars relative to the reference, the state dicts by
    :func:`max_rel_diff`; ``weights_rel`` where the reference gradient is at least
    ``CONDITIONED``, ``weights_rel_all`` everywhere (reported, not judged)."""
    missing = sorted({"loss", "grad_norm", "grads", "weights"} - set(reference) - set(other))
    missing += sorted({"loss", "grad_norm", "grads", "weights"} - set(other))
    if missing:
        raise GpuCheckError(
            f"a saved step lacks {sorted(set(missing))}; save it with the engine check"
        )

    def rel(key: str) -> float:
        a, b = float(reference[key]), float(other[key])  # type: ignore[arg-type]
        return abs(a - b) / abs(a) if a else abs(b)

    grads: Mapping[str, Tensor] = reference["grads"]  # type: ignore[assignment]
    conditioned = {n: g.abs() >= CONDITIONED for n, g in grads.items()}
    return {
        "loss_rel": rel("loss"),
        "grad_norm_rel": rel("grad_norm"),
        "grads_rel": max_rel_diff(reference["grads"], other["grads"]),  # type: ignore[arg-type]
        "weights_rel": max_rel_diff(reference["weights"], other["weights"], where=conditioned),  # type: ignore[arg-type]
        "weights_rel_all": max_rel_diff(reference["weights"], other["weights"]),  # type: ignore[arg-type]
    }
