"""FP8 training: which engine option runs it where, and the FP8 matrix multiply of
torch 2.13 on the CPU.

- ``Fsdp2RunOptions(float8_recipe=...)``: torchao's float8 training
  (``convert_to_float8_training`` before FSDP2 wraps the model: every ``nn.Linear``
  but ``lm_head`` whose sizes are multiples of 16 becomes a ``Float8Linear``) with one of
  :data:`FLOAT8_RECIPES`. Refused where torchao is not installed, with tensor
  parallelism (torchao's float8 TP styles are not wired) and with a precision policy
  (float8 runs on fp32 parameters here). :func:`float8_refusal` says why.
- ``MegatronRunOptions(fp8_recipe=...)``: refused (Transformer Engine, an FP8 GPU and
  its layer spec; :mod:`~areal_fn.runtime.engines.megatron_options`).
- :func:`fp8_linear`: ``x @ weight.T`` as FP8 training computes it, through
  ``torch._scaled_mm``, which torch 2.13 runs on the CPU with one scale per tensor or
  one per row (:data:`SCALINGS`) and refuses block scales (1x128 / 128x128).
"""

import importlib.util
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from areal_fn.errors import LayoutError
from areal_fn.plans.fp8 import block_amax, quantize_fp8
from areal_fn.plans.memory.float8 import FLOAT8_RECIPES
from areal_fn.typecheck import beartype

__all__ = [
    "FLOAT8_RECIPES",
    "SCALINGS",
    "check_float8",
    "convert_to_float8",
    "float8_refusal",
    "fp8_linear",
    "torchao_installed",
]

#: The scalings torch 2.13's ``_scaled_mm`` takes on the CPU.
SCALINGS = ("tensorwise", "rowwise")

Activations = Float[Tensor, "m k"]
Weight = Float[Tensor, "n k"]
Output = Float[Tensor, "m n"]


@beartype
def fp8_linear(
    x: Activations,
    weight: Weight,
    *,
    scaling: str = "tensorwise",
    out_dtype: torch.dtype = torch.float32,
) -> Output:
    """``x @ weight.T`` with both operands in ``float8_e4m3fn``: each scaled by
    ``amax / 448`` (of the whole tensor, or of each row with ``"rowwise"``), multiplied by
    ``torch._scaled_mm`` and the scales applied to the output in ``out_dtype``."""
    if scaling not in SCALINGS:
        raise LayoutError(
            f"fp8_linear: scaling={scaling!r} is not one torch._scaled_mm runs on the CPU; "
            f"use one of {SCALINGS} (block scales, 1x128 / 128x128, need a GPU kernel)"
        )
    qx, sx = _quantize(x, rowwise=scaling == "rowwise")
    qw, sw = _quantize(weight, rowwise=scaling == "rowwise")
    return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=out_dtype)


def _quantize(t: Tensor, *, rowwise: bool) -> tuple[Tensor, Tensor]:
    """FP8 values and scales: one ``[1, 1]`` scale, or ``[rows, 1]`` (contiguous)."""
    block = (1, t.shape[1]) if rowwise else tuple(t.shape)
    q, scale = quantize_fp8(t, block_amax(t, block=block), block=block)  # type: ignore[arg-type]
    return q, (scale.contiguous() if rowwise else scale.reshape(()))


def torchao_installed() -> bool:
    """Whether ``torchao`` can be imported (looked up, not imported)."""
    return importlib.util.find_spec("torchao") is not None


def float8_refusal(recipe: str | None, *, torchao: bool, tp: int, precision: Any, lora: Any) -> str:
    """Why ``Fsdp2Engine`` cannot train with ``float8_recipe=recipe`` ('' when it can)."""
    if recipe is None:
        return ""
    head = (
        f"Fsdp2RunOptions.float8_recipe={recipe!r} trains the linear layers with torchao's float8"
    )
    if not torchao:
        return (
            f"{head} (convert_to_float8_training), and torchao is not installed; pip install "
            "torchao (0.18 installs beside torch 2.13 without changing it), or drop float8_recipe"
        )
    if tp > 1:
        return (
            f"{head}; with tp={tp} it needs torchao's float8 TP styles, which the engine's "
            "TP plan does not use; train float8 with tp=1"
        )
    if precision is not None or lora is not None:
        what = f"precision={precision}" if precision is not None else "LoRA adapters"
        return f"{head} over plain fp32 linear layers, not with {what}; drop one of them"
    return ""


@beartype
def check_float8(recipe: str | None, *, tp: int, precision: Any = None, lora: Any = None) -> None:
    """Raise :class:`~areal_fn.errors.LayoutError` with :func:`float8_refusal`'s reason."""
    problem = float8_refusal(
        recipe, torchao=torchao_installed(), tp=tp, precision=precision, lora=lora
    )
    if problem:
        raise LayoutError(problem)


def convert_to_float8(model: nn.Module, recipe: str) -> None:
    """torchao's ``convert_to_float8_training`` of ``model`` (in place) under ``recipe``:
    every ``nn.Linear`` but ``lm_head`` whose in and out features are multiples of 16
    (what ``_scaled_mm`` takes)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and fqn.split(".")[-1] != "lm_head"
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
