"""`Transfer`: one row of a transfer plan, and the rank-list rule every planner checks.

Kept apart from :mod:`areal_fn.plans.transfer.plan` so that the planners
(:mod:`areal_fn.plans.transfer.classes`) and the plan records can both use it.
"""

from collections.abc import Sequence

import attrs

from areal_fn.errors import PlanError
from areal_fn.sharding.box import Box


@attrs.frozen(kw_only=True)
class Transfer:
    """Copy ``box`` of canonical tensor ``canonical`` from ``src`` to ``dst`` (global ranks).

    ``src_tensor[src_box]`` on the source becomes ``dst_tensor[dst_box]`` on the
    destination. ``src == dst`` is a local copy. ``offset`` is where this row's first
    byte lies on the plan's byte clock: the bytes of the whole plan (every rank) laid
    end to end in plan order, each canonical tensor starting at a multiple of its
    element size. Buckets cut this clock at fixed points, so a rank that knows only its
    own rows still knows which bucket each of them is in.
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
    offset: int

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    def __str__(self) -> str:
        return (
            f"{self.src}->{self.dst} {self.canonical}{self.box} "
            f"({self.src_tensor}{self.src_box} -> {self.dst_tensor}{self.dst_box}, "
            f"{self.nbytes} B @ {self.offset})"
        )


_NEW = object.__new__
(_S_SRC, _S_DST, _S_CAN, _S_BOX, _S_ST, _S_SB, _S_DT, _S_DB, _S_N, _S_OFF) = (
    Transfer.__dict__[f.name].__set__ for f in attrs.fields(Transfer)
)


def trusted_transfer(
    src: int,
    dst: int,
    canonical: str,
    box: Box,
    src_tensor: str,
    src_box: Box,
    dst_tensor: str,
    dst_box: Box,
    nbytes: int,
    offset: int,
) -> Transfer:
    """A :class:`Transfer` from fields already known valid (the planners' hot path)."""
    t = _NEW(Transfer)
    _S_SRC(t, src)
    _S_DST(t, dst)
    _S_CAN(t, canonical)
    _S_BOX(t, box)
    _S_ST(t, src_tensor)
    _S_SB(t, src_box)
    _S_DT(t, dst_tensor)
    _S_DB(t, dst_box)
    _S_N(t, nbytes)
    _S_OFF(t, offset)
    return t


def check_ranks(what: str, ranks: Sequence[int], world: int) -> tuple[int, ...]:
    ranks = tuple(ranks)
    if len(ranks) != world:
        raise PlanError(
            f"{what} lists {len(ranks)} ranks but its layout has {world}; give one global rank per layout rank"
        )
    if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
        raise PlanError(f"{what}={ranks} must be distinct non-negative global ranks")
    return ranks
