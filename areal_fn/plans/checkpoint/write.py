"""The save plan of a checkpoint: which rank writes which canonical box.

:func:`plan_save` deduplicates replicas: every canonical element is written by exactly
one rank. ``dedup="balanced"`` (default) gives each element to the replica that has
written the fewest bytes so far (ties to the lower rank); ``"first"`` to the first
holder in rank order. The plan is a function of the layout alone, so every rank
computes the same one. Pure: no files, no ranks, no clock.
"""

import itertools
from typing import Literal

import attrs

from areal_fn.errors import CheckpointError, LayoutError
from areal_fn.layouts.layout import Layout, LayoutKind
from areal_fn.layouts.lift import LiftedLayout, LocalView, lift_layouts
from areal_fn.model.tensor_spec import DTYPE_BYTES, TensorSpec
from areal_fn.sharding.box import Box
from areal_fn.sharding.grid import grid_cells, grid_cuts, holders_by_cell, merge_runs
from areal_fn.typecheck import beartype

Dedup = Literal["balanced", "first"]


@attrs.frozen(kw_only=True)
class WritePiece:
    """Write ``box`` of ``canonical`` from ``tensor[local_box]`` (local dtype ``dtype``)."""

    canonical: str
    box: Box
    tensor: str
    local_box: Box
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.box.numel * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.canonical}{self.box} <- {self.tensor}{self.local_box}"


@attrs.frozen(kw_only=True)
class RankWrites:
    """The pieces one rank writes, in canonical order."""

    rank: int
    pieces: tuple[WritePiece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def _check_ranks(inst: "WritePlan", _attr: object, ranks: tuple[RankWrites, ...]) -> None:
    got = tuple(r.rank for r in ranks)
    if got != tuple(range(len(ranks))):
        raise CheckpointError(
            f"WritePlan.ranks must list ranks 0..{len(ranks) - 1} in order, got {got}"
        )


@attrs.frozen(kw_only=True)
class WritePlan:
    """Which rank writes which canonical box; every element exactly once.

    ``views``: for a layout with strided pieces (gpt-oss experts under Megatron-Core),
    the view of each local tensor that its pieces' ``local_box`` index
    (:mod:`areal_fn.layouts.lift`); the boxes written stay plain canonical boxes.
    """

    kind: LayoutKind = attrs.field(converter=LayoutKind)
    world_size: int
    canonical: tuple[TensorSpec, ...]
    ranks: tuple[RankWrites, ...] = attrs.field(validator=_check_ranks)
    views: tuple[tuple[str, LocalView], ...] = ()

    def for_rank(self, rank: int) -> tuple[WritePiece, ...]:
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"rank={rank} is outside this plan's {self.world_size} ranks")
        return self.ranks[rank].pieces

    def chunks(self) -> dict[str, tuple[tuple[Box, int], ...]]:
        """Canonical name -> its (box, writer rank) chunks, sorted by box."""
        out: dict[str, list[tuple[Box, int]]] = {c.name: [] for c in self.canonical}
        for rw in self.ranks:
            for p in rw.pieces:
                out[p.canonical].append((p.box, rw.rank))
        return {k: tuple(sorted(v, key=lambda c: c[0].ranges)) for k, v in out.items()}

    def __str__(self) -> str:
        lines = [
            f"WritePlan ({self.kind}, {self.world_size} ranks): "
            + ", ".join(f"rank {r.rank} {len(r.pieces)} pieces {r.nbytes} B" for r in self.ranks)
        ]
        for rw in self.ranks:
            lines.extend(f"  {rw.rank}: {p}" for p in rw.pieces)
        return "\n".join(lines)


@attrs.frozen
class _Holder:
    rank: int
    tensor: str
    cbox: Box
    lbox: Box
    dtype: str


@beartype
def plan_save(layout: Layout, *, dedup: Dedup = "balanced") -> WritePlan:
    """Every rank's writes under ``layout``: each canonical element exactly once.

    Raises ``CheckpointError`` when some canonical element is held by no rank (the
    layout cannot save a whole model). A layout with strided pieces is planned in its
    lifted basis (:func:`lifted_for_checkpoint`): each piece then reads a view of its
    local tensor (``WritePlan.views``) and writes plain canonical boxes (a piece taking
    some phases of its units, Megatron's per-expert ``lora_B``, one per unit:
    :func:`unlift_parts`).
    """
    lifted = lifted_for_checkpoint(layout)
    plan = _plan_save(lifted.layout, dedup)
    if not lifted.views:
        return plan
    steps = dict(lifted.factors)
    ranks = []
    for rw in plan.ranks:
        pieces = []
        for p in rw.pieces:
            if p.canonical not in steps:
                pieces.append(p)
                continue
            k = p.local_box.ndim - p.box.ndim
            offset = tuple(lo - c for lo, c in zip(p.local_box.start[k:], p.box.start, strict=True))
            for up, box in unlift_parts(p.box, steps[p.canonical]):
                local = Box(ranges=p.local_box.ranges[:k] + up.shift(offset).ranges)
                pieces.append(attrs.evolve(p, box=box, local_box=local))
        ranks.append(RankWrites(rank=rw.rank, pieces=tuple(pieces)))
    return WritePlan(
        kind=layout.kind,
        world_size=layout.world_size,
        canonical=layout.canonical,
        ranks=tuple(ranks),
        views=lifted.views,
    )


_Parts = list[list[tuple[tuple[tuple[int, int], ...], tuple[int, int]]]]


def _product(per_dim: _Parts) -> tuple[tuple[Box, Box], ...]:
    return tuple(
        (
            Box._trusted(tuple(r for lifted, _ in combo for r in lifted)),
            Box._trusted(tuple(plain for _, plain in combo)),
        )
        for combo in itertools.product(*per_dim)
    )


def unlift_parts(box: Box, steps: tuple[int, ...]) -> tuple[tuple[Box, Box], ...]:
    """Lifted ``box`` as (lifted part, plain canonical box) pairs that together hold it,
    in order: one pair when it holds whole units, else one per unit of each dim whose
    phases it takes partly (a strided region is a union of plain boxes)."""
    per_dim: _Parts = []
    i = 0
    for s in steps:
        if s == 1:
            per_dim.append([((box.ranges[i],), box.ranges[i])])
            i += 1
            continue
        (u0, u1), (p0, p1) = box.ranges[i], box.ranges[i + 1]
        if (p0, p1) == (0, s):
            per_dim.append([(((u0, u1), (0, s)), (u0 * s, u1 * s))])
        else:
            per_dim.append(
                [(((u, u + 1), (p0, p1)), (u * s + p0, u * s + p1)) for u in range(u0, u1)]
            )
        i += 2
    return _product(per_dim)


def lift_parts(box: Box, steps: tuple[int, ...]) -> tuple[tuple[Box, Box], ...]:
    """Plain canonical ``box`` as (lifted part, plain part) pairs that together hold it:
    along each dim of step ``s``, its whole units as one part and each cut unit's phases
    as parts of their own."""
    per_dim: _Parts = []
    for (lo, hi), s in zip(box.ranges, steps, strict=True):
        if s == 1:
            per_dim.append([(((lo, hi),), (lo, hi))])
            continue
        parts: list[tuple[tuple[tuple[int, int], ...], tuple[int, int]]] = []
        a = lo
        while a < hi:
            u, g = divmod(a, s)
            if g == 0 and hi - a >= s:
                b = a + (hi - a) // s * s
                parts.append((((u, b // s), (0, s)), (a, b)))
            else:
                b = min(hi, (u + 1) * s)
                parts.append((((u, u + 1), (g, b - u * s)), (a, b)))
            a = b
        per_dim.append(parts)
    return _product(per_dim)


def lifted_for_checkpoint(layout: Layout) -> LiftedLayout:
    """``layout`` in its lifted basis (itself when it has no strided pieces); a layout
    that cannot be lifted is a ``CheckpointError``."""
    try:
        (lifted,) = lift_layouts(layout)
    except LayoutError as e:
        raise CheckpointError(f"checkpoint planning: {e}") from None
    return lifted


def _plan_save(layout: Layout, dedup: Dedup) -> WritePlan:
    holders: dict[str, list[_Holder]] = {c.name: [] for c in layout.canonical}
    for r in range(layout.world_size):
        for lt in layout.local_tensors(r):
            for p in lt.pieces:
                if p.canonical is not None and p.canonical_box is not None:
                    holders[p.canonical].append(
                        _Holder(r, lt.name, p.canonical_box, p.local_box, lt.dtype)
                    )
    written = [0] * layout.world_size
    out: list[list[WritePiece]] = [[] for _ in range(layout.world_size)]
    for spec in layout.canonical:
        hs = holders[spec.name]
        full = Box.full(spec.shape)
        if full.is_empty:
            continue
        boxes = [h.cbox.ranges for h in hs]
        cuts = grid_cuts(boxes, full.ranges)
        cells: list[tuple[Box, int]] = []
        for ranges, options in zip(grid_cells(cuts), holders_by_cell(cuts, boxes), strict=True):
            cell = Box._trusted(ranges)
            if not options:
                raise CheckpointError(
                    f"{spec.name}{cell} is held by no rank of the {layout.kind} layout "
                    f"({layout.world_size} ranks); a checkpoint stores whole canonical tensors, "
                    "save from a layout that holds every element"
                )
            if dedup == "first":
                choice = options[0]
            else:
                choice = min(options, key=lambda i: (written[hs[i].rank], hs[i].rank, i))
            written[hs[choice].rank] += cell.numel * DTYPE_BYTES[hs[choice].dtype]
            cells.append((cell, choice))
        for ranges, i in merge_runs([(c.ranges, i) for c, i in cells]):
            box = Box._trusted(ranges)
            h = hs[i]
            k = h.lbox.ndim - box.ndim
            inner = box.shift(
                tuple(lo - c for lo, c in zip(h.lbox.start[k:], h.cbox.start, strict=True))
            )
            out[h.rank].append(
                WritePiece(
                    canonical=spec.name,
                    box=box,
                    tensor=h.tensor,
                    local_box=Box(ranges=h.lbox.ranges[:k] + inner.ranges),
                    dtype=h.dtype,
                )
            )
    return WritePlan(
        kind=layout.kind,
        world_size=layout.world_size,
        canonical=layout.canonical,
        ranks=tuple(RankWrites(rank=r, pieces=tuple(p)) for r, p in enumerate(out)),
    )
