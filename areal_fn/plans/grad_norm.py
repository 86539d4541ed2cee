"""Gradient-norm weights from a layout: how many copies of each canonical element the
layout holds, so that every rank's local sums add up to the canonical norm once."""

import math

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import Layout
from areal_fn.sharding.box import Box
from areal_fn.sharding.placement import Partial
from areal_fn.typecheck import beartype

__all__ = ["canonical_multiplicity", "norm_weights"]


def _replicas(layout: Layout, name: str) -> int:
    """Copies of each element of logical tensor ``name``: the sharding's replicas, less
    the presence axes (a tensor present at one coordinate of an axis is not copied
    along it)."""
    t = layout.tensor(name)
    mesh, placements = t.sharding.mesh, t.sharding.placements
    for axis, p in zip(mesh.names, placements, strict=True):
        if isinstance(p, Partial):
            raise LayoutError(
                f"{name}: placement {p} on {axis!r}; a partial tensor has no gradient norm of "
                "its own, reduce it to Replicate() or Shard() first"
            )
    present = math.prod(mesh.axis_size(axis) for axis, _ in t.present)
    return t.sharding.num_replicas // present


@beartype
def canonical_multiplicity(layout: Layout) -> dict[str, int]:
    """How many copies of each canonical element the whole layout holds.

    Sums, over the layout's logical tensors, the replicas of the tensor (sizes of the
    mesh axes it is ``Replicate()`` on, presence axes excluded) times how many times
    its fusion map covers the canonical tensor. Relies on the tiling law (the local
    boxes of one logical tensor cover it once per replica) and raises where a fusion
    map covers a canonical tensor a fractional number of times. Tied pieces (a second
    canonical tensor in another's elements) are not copies: a tensor held only by them
    has no entry.
    """
    covered: dict[str, int] = {}
    for t in layout.tensors:
        reps = _replicas(layout, t.name)
        for f in t.fusion:
            if not f.tied:
                covered[f.canonical] = covered.get(f.canonical, 0) + reps * f.numel
    tied_only = {f.canonical for t in layout.tensors for f in t.fusion if f.tied} - set(covered)
    out: dict[str, int] = {}
    for spec in layout.canonical:
        if spec.name in tied_only:
            continue  # held in another tensor's elements only: counted with that one
        total = covered.get(spec.name, 0)
        numel = math.prod(spec.shape)
        if total == 0 or total % numel:
            raise LayoutError(
                f"the {layout.kind} layout holds {total} elements of {spec.name!r} "
                f"({numel} elements), not a whole number of copies; every canonical element "
                "must be held the same number of times"
            )
        out[spec.name] = total // numel
    return out


@beartype
def norm_weights(layout: Layout, rank: int) -> dict[str, tuple[tuple[Box, float], ...]]:
    """Per local tensor of ``rank``: ``(local box, 1 / multiplicity)`` of each canonical piece.

    Summing ``weight * sum(grad[box] ** 2)`` over every rank's pieces counts each
    canonical element's square once. Padding and tied pieces are left out.
    """
    mult = canonical_multiplicity(layout)
    return {
        lt.name: tuple(
            (p.local_box, 1.0 / mult[p.canonical])
            for p in lt.pieces
            if p.canonical is not None and not p.tied
        )
        for lt in layout.local_tensors(rank)
    }
