"""The transfer planner as it was before per-rank planning: the baseline of
``bench/bench_sync_plan.py``, kept verbatim apart from its name and a zero ``offset``.

It plans every destination rank in turn and balances sources with a running count of
the bytes each source has sent so far, so one rank's rows depend on every destination
planned before it: a rank can only get its rows by planning the world.
"""

import itertools
from collections.abc import Sequence

import attrs

from areal_fn.errors import PlanError
from areal_fn.layouts.layout import Layout, LocalTensor, Piece
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.transfer import Transfer, TransferPlan, check_ranks
from areal_fn.sharding.box import Box


@attrs.frozen
class _Holder:
    rank: int  # global
    tensor: str
    piece: Piece
    itemsize: int

    @property
    def cbox(self) -> Box:
        assert self.piece.canonical_box is not None
        return self.piece.canonical_box


def _cuts(boxes: Sequence[Box], outer: Box) -> list[list[int]]:
    out = []
    for d, (lo, hi) in enumerate(outer.ranges):
        pts = {lo, hi}
        for b in boxes:
            blo, bhi = b.ranges[d]
            if lo < blo < hi:
                pts.add(blo)
            if lo < bhi < hi:
                pts.add(bhi)
        out.append(sorted(pts))
    return out


def _merge_runs(cells: list[tuple[Box, int]]) -> list[tuple[Box, int]]:
    """Merge grid cells assigned to the same holder into larger boxes (dim by dim)."""
    if not cells:
        return cells
    ndim = cells[0][0].ndim
    for d in reversed(range(ndim)):
        groups: dict[tuple, list[tuple[Box, int]]] = {}
        for box, h in cells:
            key = (h, tuple(r for i, r in enumerate(box.ranges) if i != d))
            groups.setdefault(key, []).append((box, h))
        merged: list[tuple[Box, int]] = []
        for items in groups.values():
            items.sort(key=lambda x: x[0].ranges[d])
            cur = items[0]
            for nxt in items[1:]:
                if cur[0].ranges[d][1] == nxt[0].ranges[d][0]:
                    ranges = list(cur[0].ranges)
                    ranges[d] = (cur[0].ranges[d][0], nxt[0].ranges[d][1])
                    cur = (Box._trusted(tuple(ranges)), cur[1])
                else:
                    merged.append(cur)
                    cur = nxt
            merged.append(cur)
        cells = merged
    cells.sort(key=lambda x: x[0].ranges)
    return cells


def plan_transfers_before(
    src: Layout,
    dst: Layout,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
) -> TransferPlan:
    """Plan moving every destination piece from the source layout.

    ``src_ranks[i]`` / ``dst_ranks[i]`` are the global ranks of layout rank ``i``
    (default: ``range(world)`` for both, i.e. colocated). Raises ``PlanError`` when a
    destination needs canonical data the source does not hold, or shapes disagree.
    """
    src_g = check_ranks(
        "src_ranks", src_ranks if src_ranks is not None else range(src.world_size), src.world_size
    )
    dst_g = check_ranks(
        "dst_ranks", dst_ranks if dst_ranks is not None else range(dst.world_size), dst.world_size
    )
    src_shapes = {c.name: c.shape for c in src.canonical}
    for c in dst.canonical:
        if c.name in src_shapes and src_shapes[c.name] != c.shape:
            raise PlanError(
                f"canonical tensor {c.name!r} has shape {src_shapes[c.name]} in the source layout but {c.shape} "
                "in the destination; both layouts must describe the same model"
            )
    holders: dict[str, list[_Holder]] = {}
    for i, g in enumerate(src_g):
        for lt in src.local_tensors(i):
            size = DTYPE_BYTES[lt.dtype]
            for p in lt.pieces:
                if p.canonical is not None and p.canonical_box is not None:
                    holders.setdefault(p.canonical, []).append(_Holder(g, lt.name, p, size))
    sent: dict[int, int] = dict.fromkeys(src_g, 0)
    transfers: list[Transfer] = []
    for j, g in enumerate(dst_g):
        for lt in dst.local_tensors(j):
            _plan_tensor(lt, g, holders, sent, transfers)
    # Plan order: canonical tensor (checkpoint order), then destination, so that
    # consecutive buckets feed every receiver at once instead of one after another.
    position = {c.name: i for i, c in enumerate(dst.canonical)}
    dst_pos = {g: i for i, g in enumerate(dst_g)}
    order = sorted(
        range(len(transfers)),
        key=lambda i: (position[transfers[i].canonical], dst_pos[transfers[i].dst], i),
    )
    transfers = [transfers[i] for i in order]
    return TransferPlan(transfers=tuple(transfers), src_ranks=src_g, dst_ranks=dst_g)


def _plan_tensor(
    lt: LocalTensor,
    dst_rank: int,
    holders: dict[str, list[_Holder]],
    sent: dict[int, int],
    out: list[Transfer],
) -> None:
    for piece in lt.pieces:
        if piece.canonical is None or piece.canonical_box is None:
            continue
        want = piece.canonical_box
        cands: list[tuple[_Holder, Box]] = []
        for h in holders.get(piece.canonical, ()):
            inter = h.cbox.intersect(want)
            if inter is not None:
                cands.append((h, inter))
        whole = [n for n, (_, inter) in enumerate(cands) if inter == want]
        if whole:
            # fast path (the common case): holders of the whole piece; one transfer
            local = [n for n in whole if cands[n][0].rank == dst_rank]
            if local:
                choice = local[0]
            else:
                choice = min(whole, key=lambda n: (sent[cands[n][0].rank], cands[n][0].rank, n))
                sent[cands[choice][0].rank] += want.numel * cands[choice][0].itemsize
            h = cands[choice][0]
            out.append(
                Transfer(
                    src=h.rank,
                    dst=dst_rank,
                    canonical=piece.canonical,
                    box=want,
                    src_tensor=h.tensor,
                    src_box=h.piece.local_of(want),
                    dst_tensor=lt.name,
                    dst_box=piece.local_box,
                    nbytes=want.numel * h.itemsize,
                    offset=0,
                )
            )
            continue
        covered_by = [i for _, i in cands]
        cuts = _cuts(covered_by, want)
        cells: list[tuple[Box, int]] = []
        for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
            cell = Box._trusted(tuple((c[k], c[k + 1]) for c, k in zip(cuts, idx, strict=True)))
            options = [n for n, (_, inter) in enumerate(cands) if inter.contains(cell)]
            if not options:
                raise PlanError(
                    f"destination rank {dst_rank} needs {piece.canonical}{cell} for {lt.name!r}, which no "
                    "source rank holds; the source layout must cover every canonical tensor the destination needs"
                )
            local = [n for n in options if cands[n][0].rank == dst_rank]
            if local:
                choice = local[0]
            else:
                choice = min(options, key=lambda n: (sent[cands[n][0].rank], cands[n][0].rank, n))
            cells.append((cell, choice))
            if not local:
                sent[cands[choice][0].rank] += cell.numel * cands[choice][0].itemsize
        for box, n in _merge_runs(cells):
            h = cands[n][0]
            src_box = h.piece.local_of(box)  # local coordinates (stacked dims included)
            dst_box = piece.local_of(box)
            out.append(
                Transfer(
                    src=h.rank,
                    dst=dst_rank,
                    canonical=piece.canonical,
                    box=box,
                    src_tensor=h.tensor,
                    src_box=src_box,
                    dst_tensor=lt.name,
                    dst_box=dst_box,
                    nbytes=box.numel * h.itemsize,
                    offset=0,
                )
            )
