"""FP8 training's FP8 copies: what torchao's float8 training creates during a step.

``Fsdp2RunOptions(float8_recipe=...)`` converts every ``nn.Linear`` but ``lm_head``
whose in and out features are multiples of 16 to torchao's ``Float8Linear``
(:func:`float8_linears` names them from the canonical tensors: the 2-D weights of the
decoder layers, routed experts and routers left out, as transformers builds them). Its
parameters, gradients and AdamW states are the plain fp32 ones
(``PrecisionPolicy.fp32()``): ``Float8Linear`` keeps no FP8 copy between steps and
saves the high-precision input and weight for the backward pass, as ``nn.Linear`` does.
What it adds is transient: each matrix multiply casts its operands to FP8 (one byte an
element) and frees them when it returns, so one layer's copies are alive at a time.

Per converted layer of ``out x in`` features over ``T`` tokens (``T`` the micro-batch's
tokens on a rank), the most FP8 bytes alive at once, in its backward pass:

- ``tensorwise``, ``rowwise``: the weight (``out * in``), the output gradient twice
  (cast for the input gradient and, along the other axis, for the weight gradient:
  ``2 T out``) and the input (``T in``);
- ``rowwise_with_gw_hp`` (the weight gradient in high precision): the weight and the
  larger of the input (forward) and the output gradient (backward): ``T max(in, out)``.

:func:`float8_copies` is the largest of these over the converted layers, its weight
part alone when ``T`` is not known. Their scales (one fp32 number per tensor, or per row
with the rowwise recipes) are not counted.
"""

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.families.mapping import Dim
from areal_fn.model.families.roles import tp_record
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.plans.memory.estimate import MemoryReport
from areal_fn.typecheck import beartype

__all__ = ["FLOAT8_RECIPES", "Float8Copies", "float8_copies", "float8_linears", "with_float8"]

#: torchao's ``Float8LinearRecipeName`` values.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _linear_weights(model: ModelSpec) -> tuple[TensorSpec, ...]:
    """The weights of the ``nn.Linear`` layers transformers builds in the decoder layers:
    their 2-D ``.weight`` tensors but routed experts (fused parameters) and routers."""
    out = []
    for t in model.tensors:
        parts = t.name.split(".")
        if len(t.shape) != 2 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
            continue
        if int(parts[2]) >= model.num_layers:
            continue  # multi-token prediction layers (not built)
        rec = tp_record(model.family, t.name)
        if rec is not None and (rec.expert or rec.stacked or rec.shape[:1] == (Dim.EXPERTS,)):
            continue  # routed experts (fused parameters) and routers (their own modules)
        out.append(t)
    return tuple(out)


@beartype
def float8_linears(model: ModelSpec) -> tuple[TensorSpec, ...]:
    """The weights of the layers float8 training converts, in checkpoint order: the
    decoder layers' ``nn.Linear`` weights (not routed experts, which are fused
    parameters, nor routers) whose both sizes are multiples of 16."""
    return tuple(t for t in _linear_weights(model) if not (t.shape[0] % 16 or t.shape[1] % 16))


@attrs.frozen(kw_only=True)
class Float8Copies:
    """The most FP8 bytes float8 training holds at once on a rank: ``weight_bytes`` of
    the weight copy and ``activation_bytes`` of input and gradient copies of the layer
    ``layer`` (the one where their sum peaks) over ``tokens`` tokens (0: not counted)."""

    recipe: str
    linears: int
    layer: str
    tokens: int
    weight_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.activation_bytes


def _activation_elements(recipe: str, tokens: int, out: int, inp: int) -> int:
    if recipe == "rowwise_with_gw_hp":
        return tokens * max(inp, out)
    return tokens * (2 * out + inp)


@beartype
def float8_copies(model: ModelSpec, recipe: str, *, tokens: int = 0) -> Float8Copies:
    """The FP8 copies of ``recipe`` at their peak (see the module docstring); ``tokens``:
    a micro-batch's tokens on a rank (0: the weight copy alone)."""
    if recipe not in FLOAT8_RECIPES:
        raise SpecError(
            f"float8 recipe {recipe!r} is not one of torchao's; use one of {FLOAT8_RECIPES}"
        )
    if tokens < 0:
        raise SpecError(f"float8_copies: tokens={tokens} must be >= 0 (0: weight copies only)")
    linears = float8_linears(model)
    if not linears:
        raise SpecError(
            f"float8 recipe {recipe!r}: {model.model_type} has no linear layer float8 training "
            "converts (every nn.Linear but lm_head whose sizes are multiples of 16); drop it"
        )

    def peak(t: TensorSpec) -> tuple[int, int]:
        out, inp = t.shape
        return out * inp + _activation_elements(recipe, tokens, out, inp), out * inp

    best = max(linears, key=peak)  # the first such layer among equals
    total, weight = peak(best)
    return Float8Copies(
        recipe=recipe,
        linears=len(linears),
        layer=best.name,
        tokens=tokens,
        weight_bytes=weight,
        activation_bytes=total - weight,
    )


@beartype
def with_float8(report: MemoryReport, copies: Float8Copies) -> MemoryReport:
    """``report`` with ``copies`` added to every rank's ``buffers`` (FSDP2 gathers each
    weight whole, so every rank casts the same layers)."""
    if report.kind != "fsdp2":
        raise SpecError(
            f"with_float8: float8 training runs in the FSDP2 engine, not in a {report.kind} "
            "layout; pass the report of an fsdp2 layout"
        )
    rows = tuple(attrs.evolve(r, buffers=r.buffers + copies.total) for r in report.rows)
    return attrs.evolve(report, rows=rows)
