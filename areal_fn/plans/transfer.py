"""Resharding plans: which bytes go from which source rank to which destination rank.

``plan_transfers(src, dst, src_ranks=..., dst_ranks=...)`` intersects the
destination layout's pieces with the source layout's pieces. Every destination
element of every non-padding piece is received exactly once; a destination rank that
already holds an element as a source (colocated layouts) copies it locally; otherwise
the source is chosen deterministically among the replicas holding it, balancing bytes
sent. The result is data: readable, diffable, and identical on every rank that
computes it.
"""

import itertools
from collections.abc import Sequence

import attrs

from areal_fn.errors import PlanError
from areal_fn.layouts.layout import Layout, LocalTensor, Piece
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype


@attrs.frozen(kw_only=True)
class Transfer:
    """Copy ``box`` of canonical tensor ``canonical`` from ``src`` to ``dst`` (global ranks).

    ``src_tensor[src_box]`` on the source becomes ``dst_tensor[dst_box]`` on the
    destination. ``src == dst`` is a local copy.
    """

    src: int
    dst: int
    canonical: str
    box: Box
    src_tensor: str
    src_box: Box
    dst_tensor: str
    dst_box: Box
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    def __str__(self) -> str:
        return (
            f"{self.src}->{self.dst} {self.canonical}{self.box} "
            f"({self.src_tensor}{self.src_box} -> {self.dst_tensor}{self.dst_box}, {self.nbytes} B)"
        )


@attrs.frozen(kw_only=True)
class TransferPlan:
    """An ordered tuple of transfers, with byte accounting.

    The least bytes any plan must move is :func:`areal_fn.transfer_lower_bound`,
    computed from the two layouts alone.
    """

    transfers: tuple[Transfer, ...]
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]

    @property
    def bytes_total(self) -> int:
        """Bytes that cross between ranks (local copies excluded)."""
        return sum(t.nbytes for t in self.transfers if not t.is_local)

    def send_bytes(self) -> dict[int, int]:
        out = dict.fromkeys(self.src_ranks, 0)
        for t in self.transfers:
            if not t.is_local:
                out[t.src] += t.nbytes
        return out

    def recv_bytes(self) -> dict[int, int]:
        out = dict.fromkeys(self.dst_ranks, 0)
        for t in self.transfers:
            if not t.is_local:
                out[t.dst] += t.nbytes
        return out

    def for_rank(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers in which ``rank`` sends or receives, in plan order."""
        return tuple(t for t in self.transfers if rank in (t.src, t.dst))

    def __str__(self) -> str:
        head = f"TransferPlan: {len(self.transfers)} transfers, {self.bytes_total} B across ranks"
        return "\n".join([head, *(f"  {t}" for t in self.transfers)])


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


def check_ranks(what: str, ranks: Sequence[int], world: int) -> tuple[int, ...]:
    ranks = tuple(ranks)
    if len(ranks) != world:
        raise PlanError(
            f"{what} lists {len(ranks)} ranks but its layout has {world}; give one global rank per layout rank"
        )
    if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
        raise PlanError(f"{what}={ranks} must be distinct non-negative global ranks")
    return ranks


@beartype
def plan_transfers(
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
                )
            )


# -- buckets ---------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class Bucket:
    """Consecutive transfers that travel together (each side packs/unpacks in order)."""

    index: int
    transfers: tuple[Transfer, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@attrs.frozen(kw_only=True)
class BucketPlan:
    """A transfer plan cut into buckets of at most ``max_bytes``, tagged with ``version``."""

    version: int
    max_bytes: int
    buckets: tuple[Bucket, ...]

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for b in self.buckets for t in b.transfers)

    def __str__(self) -> str:
        lines = [
            f"BucketPlan v{self.version}: {len(self.buckets)} buckets of <= {self.max_bytes} B"
        ]
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: {len(b.transfers)} transfers, {b.nbytes} B")
        return "\n".join(lines)


def _split_transfer(t: Transfer, max_bytes: int) -> list[Transfer]:
    if t.nbytes <= max_bytes:
        return [t]
    itemsize = t.nbytes // t.box.numel
    # split the outermost dim with extent > 1 into slabs that fit (recursively deeper)
    d = next(i for i, s in enumerate(t.box.shape) if s > 1)
    inner = t.box.numel // t.box.shape[d]
    rows = max(1, max_bytes // (inner * itemsize))
    out: list[Transfer] = []
    for start in range(0, t.box.shape[d], rows):
        stop = min(start + rows, t.box.shape[d])

        def cut(b: Box, d: int = d, start: int = start, stop: int = stop) -> Box:
            # canonical dim d is local dim d + k: a local box may lead with k stacked
            # dims of extent 1 (FSDP2's [E, ...] experts), as in Piece.local_of
            k = b.ndim - t.box.ndim
            r = list(b.ranges)
            r[d + k] = (b.ranges[d + k][0] + start, b.ranges[d + k][0] + stop)
            return Box._trusted(tuple(r))

        part = attrs.evolve(
            t,
            box=cut(t.box),
            src_box=cut(t.src_box),
            dst_box=cut(t.dst_box),
            nbytes=(stop - start) * inner * itemsize,
        )
        out.extend(_split_transfer(part, max_bytes))
    return out


@beartype
def bucket(plan: TransferPlan, max_bytes: int, *, version: int = 0) -> BucketPlan:
    """Cut ``plan`` into buckets of at most ``max_bytes`` each, in plan order.

    Both sides compute the same buckets from the same plan: no metadata travels. A
    transfer larger than ``max_bytes`` is split into slabs along its outermost dim
    (deeper dims when one slab is still too large). Local copies are bucketed too.
    """
    if max_bytes < 1:
        raise PlanError(
            f"bucket max_bytes={max_bytes} must be >= 1 byte; use e.g. 256 MiB = {256 << 20}"
        )
    if version < 0:
        raise PlanError(f"bucket version={version} must be >= 0")
    for t in plan.transfers:
        itemsize = t.nbytes // max(1, t.box.numel)
        if itemsize > max_bytes:
            raise PlanError(
                f"max_bytes={max_bytes} is smaller than one element ({itemsize} B) of {t.canonical!r}"
            )
    buckets: list[Bucket] = []
    cur: list[Transfer] = []
    size = 0
    for t in plan.transfers:
        for part in _split_transfer(t, max_bytes):
            if cur and size + part.nbytes > max_bytes:
                buckets.append(Bucket(index=len(buckets), transfers=tuple(cur)))
                cur, size = [], 0
            cur.append(part)
            size += part.nbytes
    if cur:
        buckets.append(Bucket(index=len(buckets), transfers=tuple(cur)))
    return BucketPlan(version=version, max_bytes=max_bytes, buckets=tuple(buckets))
