"""Layouts of a weight sync into an FP8 rollout deployment (block FP8, ``weight_scale_inv``).

An FP8 deployment (vLLM, SGLang serving an FP8 checkpoint) holds each weight that
:func:`~areal_fn.model.quantized.is_fp8_quantized` names as ``float8_e4m3fn`` values
(one byte per element) and beside it, on every rank holding part of it, the float32
scales of the blocks its part touches (``x.weight_scale_inv``); the other tensors
(embeddings, norms, routers, biases, ``fmt.keep``) stay in the model's dtype.
:func:`fp8_layout` turns any layout into that one: the quantised weights' canonical
dtype and their logical tensors' dtype become ``float8_e4m3fn``, and every rank holding
a piece of weight ``w`` gets one more tensor ``scale_name(w)`` (present on that rank
alone), whose one piece is the box of ``w``'s scale grid its piece touches
(:meth:`~areal_fn.plans.fp8.Fp8ShardPlan.scale_box`). A block two ranks' pieces cut
is held by both: the same scale, so either one is a source for it.

The same function gives both sides of the sync: the trainer's local FP8 tensors and
scales (what :func:`fp8_quantization` lets its ranks compute from their bf16/fp32
shards) and the deployment's. The existing planner
(:func:`~areal_fn.plans.transfer.plan_transfers`) and bound
(:func:`~areal_fn.plans.transfer.bound.transfer_lower_bound`) then plan and count FP8
bytes and scales, and the executor moves them unchanged.

:func:`fp8_quantization` says, for every quantised weight of a source layout, how its
ranks quantise their pieces together (:func:`~areal_fn.plans.fp8.plan_fp8_shards`
over the distinct pieces: a rank holding a replica of another's piece computes the
same bytes from the same data).
"""

import attrs

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece, Layout, LogicalTensor
from areal_fn.model.quantized import Fp8Format, is_fp8_quantized, scale_name
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.plans.fp8 import Fp8ShardPlan, plan_fp8_shards, scale_grid
from areal_fn.sharding.box import Box
from areal_fn.sharding.sharding import Sharding
from areal_fn.typecheck import beartype

__all__ = ["FP8_DTYPE", "Fp8Quantization", "fp8_layout", "fp8_quantization"]

#: The dtype of the values of an FP8 deployment's weights.
FP8_DTYPE = "float8_e4m3fn"
_EMPTY = Box._trusted(((0, 0), (0, 0)))
#: (local tensor name, canonical box, local box) of one rank's piece of a weight
_Held = tuple[str, Box, Box]


@attrs.frozen(kw_only=True)
class Fp8Quantization:
    """How the ranks of a layout quantise weight ``name`` together."""

    name: str
    #: the plan over the distinct pieces (the last box is empty when some rank holds none)
    plan: Fp8ShardPlan
    #: per layout rank, its index into ``plan.boxes`` (the empty box for no piece)
    slots: tuple[int, ...]
    #: per layout rank, (local tensor name, canonical box, local box) of its piece, or None
    pieces: tuple[_Held | None, ...]


def _quantized(layout: Layout, fmt: Fp8Format) -> dict[str, TensorSpec]:
    out = {c.name: c for c in layout.canonical if is_fp8_quantized(c.name, c.shape, fmt)}
    clash = sorted(
        scale_name(n) for n in out if scale_name(n) in {c.name for c in layout.canonical}
    )
    if clash:
        raise LayoutError(
            f"the model already has tensors {clash[:3]} named as the scales of its quantised "
            "weights; an FP8 layout adds them: pass the model's unquantised tensors"
        )
    if layout.is_strided:
        raise LayoutError(
            f"this {layout.kind} layout has strided pieces (gpt-oss experts under Megatron); "
            "block FP8 quantises plain boxes of 2-d weights: sync into an FP8 deployment from "
            "an unstrided layout (FSDP2, or an inference layout)"
        )
    return out


def _held(layout: Layout, names: dict[str, TensorSpec]) -> dict[str, list[_Held | None]]:
    """Per quantised weight, per rank: its piece (:data:`_Held`) or None."""
    out: dict[str, list[_Held | None]] = {n: [None] * layout.world_size for n in names}
    for r in range(layout.world_size):
        for lt in layout.local_tensors(r):
            for p in lt.pieces:
                if p.canonical not in names or p.tied:
                    continue
                held = out[p.canonical]
                before = held[r]
                if before is not None:
                    raise LayoutError(
                        f"rank {r} holds two pieces of {p.canonical!r} (in "
                        f"{sorted({before[0], lt.name})}); block FP8 quantises one piece of a "
                        "weight per rank: use a layout (degrees) that gives each rank one"
                    )
                assert p.canonical_box is not None
                held[r] = (lt.name, p.canonical_box, p.local_box)
    return out


def _logical(t: LogicalTensor, names: dict[str, TensorSpec]) -> LogicalTensor:
    inside = {f.canonical in names for f in t.fusion}
    if inside == {True}:
        return attrs.evolve(t, dtype=FP8_DTYPE)
    if inside == {True, False}:
        mixed = sorted({f.canonical for f in t.fusion})
        raise LayoutError(
            f"{t.name} fuses quantised and unquantised tensors {mixed[:4]}; an FP8 deployment "
            "stores them in different dtypes: use a layout that keeps them apart"
        )
    return t


def _scales(
    layout: Layout, name: str, held: list[_Held | None], fmt: Fp8Format
) -> list[LogicalTensor]:
    out = []
    for r, h in enumerate(held):
        if h is None:
            continue
        mesh = layout.tensor(h[0]).sharding.mesh
        grid = Box._trusted(
            tuple(
                (lo // b, -(-hi // b)) for (lo, hi), b in zip(h[1].ranges, fmt.block, strict=True)
            )
        )
        out.append(
            LogicalTensor(
                name=scale_name(name),
                shape=grid.shape,
                dtype="float32",
                fusion=(
                    FusionPiece(
                        canonical=scale_name(name),
                        canonical_box=grid,
                        logical_box=Box.full(grid.shape),
                    ),
                ),
                sharding=Sharding.replicated(mesh),
                present=tuple(zip(mesh.names, mesh.coords(r), strict=True)),
            )
        )
    return out


@beartype
def fp8_layout(layout: Layout, fmt: Fp8Format) -> Layout:
    """``layout`` as an FP8 deployment holds it (see the module): the weights
    :func:`~areal_fn.model.quantized.is_fp8_quantized` names in ``float8_e4m3fn`` and one
    ``scale_name(w)`` tensor (float32, this rank's blocks) per rank holding a piece of ``w``.

    ``LayoutError`` for a layout with strided pieces, a logical tensor fusing quantised
    and unquantised tensors, a rank holding two pieces of one weight, and a model that
    already has tensors named like the scales."""
    names = _quantized(layout, fmt)
    held = _held(layout, names)
    canonical: list[TensorSpec] = []
    for c in layout.canonical:
        if c.name not in names:
            canonical.append(c)
            continue
        canonical.append(TensorSpec(name=c.name, shape=c.shape, dtype=FP8_DTYPE))
        grid = scale_grid((c.shape[0], c.shape[1]), fmt.block)
        canonical.append(TensorSpec(name=scale_name(c.name), shape=grid, dtype="float32"))
    tensors = [_logical(t, names) for t in layout.tensors]
    for n in names:
        tensors.extend(_scales(layout, n, held[n], fmt))
    return Layout(
        kind=layout.kind,
        world_size=layout.world_size,
        canonical=tuple(canonical),
        tensors=tuple(tensors),
        stages=layout.stages,
    )


@beartype
def fp8_quantization(layout: Layout, fmt: Fp8Format) -> tuple[Fp8Quantization, ...]:
    """For every weight of ``layout`` that :func:`fp8_layout` quantises, in canonical
    order: the plan by which its ranks quantise their pieces (every rank of the layout
    takes part, in this order: :func:`~areal_fn.runtime.hf.fp8_shards.quantize_shard`
    is collective). Refusals as :func:`fp8_layout`'s."""
    names = _quantized(layout, fmt)
    held = _held(layout, names)
    out = []
    for n, spec in names.items():
        boxes: list[Box] = []
        slots = []
        for h in held[n]:
            box = _EMPTY if h is None else h[1]
            if box not in boxes:
                boxes.append(box)
            slots.append(boxes.index(box))
        plan = plan_fp8_shards((spec.shape[0], spec.shape[1]), boxes, block=fmt.block)
        out.append(Fp8Quantization(name=n, plan=plan, slots=tuple(slots), pieces=tuple(held[n])))
    return tuple(out)
