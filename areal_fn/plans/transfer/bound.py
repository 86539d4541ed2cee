"""The least bytes any resharding from one layout to another must move between ranks.

Computed from the two layouts alone, independently of :func:`plan_transfers`: for
each destination rank, the canonical elements its pieces need (each element once,
however many of its local tensors hold it) minus the elements the same global rank
already holds in the source layout, in bytes of the source layout's canonical dtype.
No plan can move fewer bytes across ranks, so a plan's ``bytes_total`` measured
against this bound is evidence, not a tautology. Layouts with strided pieces are
counted in their lifted basis (:mod:`areal_fn.layouts.lift`), which holds the same
elements.
"""

import itertools
from collections.abc import Iterable, Sequence

from areal_fn.errors import PlanError
from areal_fn.layouts.layout import Layout
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.transfer.plan import check_ranks, lifted_pair
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

__all__ = ["required_bytes", "transfer_lower_bound"]


def union_numel(boxes: Iterable[Box]) -> int:
    """Elements covered by the union of ``boxes`` (all of one rank), each counted once."""
    ranges = [b.ranges for b in boxes if not b.is_empty]
    return _union(ranges)


def _union(ranges: list[tuple[tuple[int, int], ...]]) -> int:
    if not ranges:
        return 0
    if len(ranges[0]) == 0:
        return 1  # scalars: one element
    if len(ranges[0]) == 1:
        total, end = 0, -1
        for lo, hi in sorted(r[0] for r in ranges):
            if hi <= end:
                continue
            total += hi - max(lo, end)
            end = hi
        return total
    if len(ranges) == 1:
        n = 1
        for lo, hi in ranges[0]:
            n *= hi - lo
        return n
    # sweep the first dim: between consecutive cuts the same boxes span the slab
    cuts = sorted({x for r in ranges for x in r[0]})
    total = 0
    for lo, hi in itertools.pairwise(cuts):
        rest = [r[1:] for r in ranges if r[0][0] <= lo and hi <= r[0][1]]
        if rest:
            total += (hi - lo) * _union(rest)
    return total


def _held(layout: Layout, rank: int) -> dict[str, list[Box]]:
    out: dict[str, list[Box]] = {}
    for lt in layout.local_tensors(rank):
        for p in lt.pieces:
            if p.canonical is not None and p.canonical_box is not None:
                out.setdefault(p.canonical, []).append(p.canonical_box)
    return out


@beartype
def required_bytes(
    src: Layout,
    dst: Layout,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """``(global destination rank, bytes it must receive from other ranks at the least)``.

    ``src_ranks[i]`` / ``dst_ranks[i]`` are the global ranks of layout rank ``i``
    (default ``range(world)``: colocated). Bytes are counted in the source layout's
    canonical dtype, the dtype the source sends.
    """
    lifted_src, lifted_dst = lifted_pair(src, dst)
    src, dst = lifted_src.layout, lifted_dst.layout
    # the rank lists follow the planner's rule (one owner); the bound itself does not
    src_g = check_ranks(
        "src_ranks", range(src.world_size) if src_ranks is None else src_ranks, src.world_size
    )
    dst_g = check_ranks(
        "dst_ranks", range(dst.world_size) if dst_ranks is None else dst_ranks, dst.world_size
    )
    itemsize = {c.name: DTYPE_BYTES[c.dtype] for c in src.canonical}
    src_index = {g: i for i, g in enumerate(src_g)}
    out = []
    for j, g in enumerate(dst_g):
        need = _held(dst, j)
        held = _held(src, src_index[g]) if g in src_index else {}
        total = 0
        for name, boxes in need.items():
            if name not in itemsize:
                raise PlanError(
                    f"destination rank {g} needs canonical tensor {name!r}, which the source "
                    "layout does not have; both layouts must describe the same model"
                )
            mine = held.get(name, [])
            # |need \ held| = |need u held| - |held|, with held clipped to the need
            clipped = [c for b in mine for w in boxes if (c := b.intersect(w)) is not None]
            missing = union_numel([*boxes, *clipped]) - union_numel(clipped)
            total += missing * itemsize[name]
        out.append((g, total))
    return tuple(out)


@beartype
def transfer_lower_bound(
    src: Layout,
    dst: Layout,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
) -> int:
    """Bytes that no resharding from ``src`` to ``dst`` can avoid moving across ranks."""
    return sum(b for _, b in required_bytes(src, dst, src_ranks=src_ranks, dst_ranks=dst_ranks))
