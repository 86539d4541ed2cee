"""Resharding plans: which bytes go from which source rank to which destination rank.

``plan_transfers(src, dst, src_ranks=..., dst_ranks=...)`` intersects the
destination layout's pieces with the source layout's pieces. Every destination
element of every non-padding piece is received exactly once; a destination rank that
already holds an element as a source (colocated layouts) copies it locally; otherwise
the replicas holding it take turns, by a rule local to each destination piece
(:mod:`areal_fn.plans.transfer.classes`). The result is data: readable, diffable, and
identical on every rank that computes it. ``plan_rank_transfers(src, dst, rank, ...)``
computes one rank's rows of the same plan alone, and :func:`bucket` cuts either into
the same buckets.
"""

from collections.abc import Sequence

import attrs

from areal_fn.errors import LayoutError, PlanError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.lift import LiftedLayout, LocalView, lift_layouts
from areal_fn.plans.transfer.classes import Planner, no_gc
from areal_fn.plans.transfer.records import Transfer as Transfer
from areal_fn.plans.transfer.records import check_ranks as check_ranks
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype


@attrs.frozen(kw_only=True)
class TransferPlan:
    """An ordered tuple of transfers, with byte accounting.

    The least bytes any plan must move is :func:`areal_fn.transfer_lower_bound`,
    computed from the two layouts alone.

    Between layouts with strided pieces (gpt-oss experts under Megatron-Core) the plan
    is made in the lifted basis (:mod:`areal_fn.layouts.lift`): ``lifted`` gives the
    step per dim of each canonical tensor whose boxes are lifted, and ``src_views`` /
    ``dst_views`` the view of each local tensor the rows' boxes index (the executor and
    :func:`~areal_fn.plans.transfer.apply.apply_transfers` apply them). All three are
    empty otherwise.
    """

    transfers: tuple[Transfer, ...]
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    src_views: tuple[tuple[str, LocalView], ...] = ()
    dst_views: tuple[tuple[str, LocalView], ...] = ()
    lifted: tuple[tuple[str, tuple[int, ...]], ...] = ()

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


def lifted_pair(src: Layout, dst: Layout) -> tuple[LiftedLayout, LiftedLayout]:
    """Both layouts in one lifted basis (themselves when neither has strided pieces);
    a pair that cannot be lifted is a ``PlanError``."""
    try:
        lifted_src, lifted_dst = lift_layouts(src, dst)
    except LayoutError as e:
        raise PlanError(f"weight-sync planning: {e}") from None
    return lifted_src, lifted_dst


def _planner(
    src: Layout, dst: Layout, src_ranks: Sequence[int] | None, dst_ranks: Sequence[int] | None
) -> Planner:
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
    return Planner(src, dst, src_g, dst_g)


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
    Sources are chosen per destination piece (:mod:`areal_fn.plans.transfer.classes`),
    so :func:`plan_rank_transfers` gives any one rank's rows of this plan alone.
    """
    lifted_src, lifted_dst = lifted_pair(src, dst)
    with no_gc():
        planner = _planner(lifted_src.layout, lifted_dst.layout, src_ranks, dst_ranks)
        rows = tuple(planner.world())
    return _plan(rows, planner, lifted_src, lifted_dst)


def _plan(
    rows: tuple[Transfer, ...], planner: Planner, src: LiftedLayout, dst: LiftedLayout
) -> TransferPlan:
    return TransferPlan(
        transfers=rows,
        src_ranks=planner.src.ranks,
        dst_ranks=planner.dst.ranks,
        src_views=src.views,
        dst_views=dst.views,
        lifted=src.factors,
    )


@beartype
def plan_rank_transfers(
    src: Layout,
    dst: Layout,
    rank: int,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
) -> TransferPlan:
    """The rows of ``plan_transfers(src, dst, ...)`` in which global ``rank`` sends or
    receives, in plan order, planned without the other ranks' rows.

    Equal to ``plan_transfers(...).for_rank(rank)`` (a law), offsets included, so
    :func:`bucket` puts each row in the same bucket on both of its ranks without any
    metadata travelling. A rank in neither layout gets no rows. A canonical tensor that
    this rank does not touch is checked only for being held at all.
    """
    lifted_src, lifted_dst = lifted_pair(src, dst)
    with no_gc():  # the planner makes many small acyclic objects; see no_gc
        planner = _planner(lifted_src.layout, lifted_dst.layout, src_ranks, dst_ranks)
        rows = tuple(planner.rank(rank))
    return _plan(rows, planner, lifted_src, lifted_dst)


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
    """A transfer plan cut into buckets of at most ``max_bytes``, tagged with ``version``;
    the plan's views of the local tensors (see :class:`TransferPlan`) come along."""

    version: int
    max_bytes: int
    buckets: tuple[Bucket, ...]
    src_views: tuple[tuple[str, LocalView], ...] = ()
    dst_views: tuple[tuple[str, LocalView], ...] = ()

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


def grid_step(max_bytes: int) -> int:
    """The byte clock's bucket length for ``max_bytes``: a multiple of every element size
    up to 8 bytes (``max_bytes`` rounded down to 8, or to a power of two below 8), so that
    no element straddles two buckets."""
    if max_bytes >= 8:
        return max_bytes - max_bytes % 8
    return 1 << (max_bytes.bit_length() - 1)


def _linear(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, int], ...]]:
    """Elements ``a:b`` (row-major) of a box of ``shape``, as boxes relative to its start."""
    if a >= b:
        return []
    if not shape:
        return [()]
    inner = 1
    for n in shape[1:]:
        inner *= n
    r0, a_in = divmod(a, inner)
    r1, b_in = divmod(b, inner)
    if r0 == r1:
        return [((r0, r0 + 1), *sub) for sub in _linear(shape[1:], a_in, b_in)]
    out = []
    if a_in:
        out += [((r0, r0 + 1), *sub) for sub in _linear(shape[1:], a_in, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1), *((0, n) for n in shape[1:])))
    if b_in:
        out += [((r1, r1 + 1), *sub) for sub in _linear(shape[1:], 0, b_in)]
    return out


def _cut(b: Box, rel: tuple[tuple[int, int], ...]) -> Box:
    # canonical dim d is local dim d + k: a local box may lead with k stacked dims of
    # extent 1 (FSDP2's [E, ...] experts), as in Piece.local_of
    k = b.ndim - len(rel)
    r = b.ranges
    return Box._trusted(
        r[:k] + tuple((r[k + d][0] + lo, r[k + d][0] + hi) for d, (lo, hi) in enumerate(rel))
    )


def _split(t: Transfer, step: int) -> list[tuple[int, Transfer]]:
    """``t`` cut where the byte clock crosses a multiple of ``step``: (bucket, part) pairs."""
    first, last = t.offset // step, (t.offset + t.nbytes - 1) // step
    if first == last or t.nbytes == 0:
        return [(first, t)]
    itemsize = t.nbytes // t.box.numel
    shape = t.box.shape
    strides = [1] * len(shape)
    for d in reversed(range(len(shape) - 1)):
        strides[d] = strides[d + 1] * shape[d + 1]
    out = []
    for b in range(first, last + 1):
        lo = (max(t.offset, b * step) - t.offset) // itemsize
        hi = (min(t.offset + t.nbytes, (b + 1) * step) - t.offset) // itemsize
        for rel in _linear(shape, lo, hi):
            box = _cut(t.box, rel)
            start = sum(r0 * st for (r0, _), st in zip(rel, strides, strict=True))
            part = attrs.evolve(
                t,
                box=box,
                src_box=_cut(t.src_box, rel),
                dst_box=_cut(t.dst_box, rel),
                nbytes=box.numel * itemsize,
                offset=t.offset + start * itemsize,
            )
            out.append((b, part))
    return out


@beartype
def bucket(plan: TransferPlan, max_bytes: int, *, version: int = 0) -> BucketPlan:
    """Cut ``plan`` into buckets of at most ``max_bytes`` each, in plan order.

    Bucket ``b`` holds the bytes at ``[b * step, (b + 1) * step)`` of the plan's byte
    clock (:attr:`Transfer.offset`; ``step`` is :func:`grid_step` of ``max_bytes``),
    and a transfer crossing a multiple of ``step`` is cut there into boxes. A row's
    bucket depends on that row alone, so both sides compute the same buckets, from the
    whole plan or from their own rows (:func:`plan_rank_transfers`): no metadata
    travels. A rank's own plan lists only the buckets it takes part in, under their
    indices in the whole plan. Local copies are bucketed too.
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
    step = grid_step(max_bytes)
    found: dict[int, list[Transfer]] = {}
    for t in plan.transfers:
        for b, part in _split(t, step):
            found.setdefault(b, []).append(part)
    buckets = tuple(Bucket(index=b, transfers=tuple(found[b])) for b in sorted(found))
    return BucketPlan(
        version=version,
        max_bytes=max_bytes,
        buckets=buckets,
        src_views=plan.src_views,
        dst_views=plan.dst_views,
    )
