"""Placements: how one mesh axis distributes a tensor (DTensor's vocabulary).

``Replicate()``, ``Shard(dim)``, ``StridedShard(dim, split_factor)``, ``Partial(op)``.
``repr`` is valid Python (``Shard(dim=0)``); ``str`` is short (``S(0)``, ``R``,
``SS(0,2)``, ``P(sum)``).
"""

from typing import Literal, TypeAlias

import attrs

from areal_fn.errors import SpecError

ReduceOp: TypeAlias = Literal["sum", "avg", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


def _check_dim(_inst: object, attr: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(
            f"{type(_inst).__name__}.{attr.name}={value!r} must be an int >= 0 "
            "(normalise negative dims against the tensor's ndim first)"
        )


def _check_split_factor(_inst: object, _attr: object, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(
            f"StridedShard.split_factor={value!r} must be an int >= 1: it is the number of "
            "blocks the dim is cut into before this axis shards each block"
        )


def _check_op(_inst: object, _attr: object, value: str) -> None:
    if value not in REDUCE_OPS:
        raise SpecError(f"Partial.op={value!r} is not a reduction; use one of {REDUCE_OPS}")


@attrs.frozen(kw_only=True)
class Replicate:
    """Every rank along the axis holds the same data."""

    def __str__(self) -> str:
        return "R"


# Shard, StridedShard and Partial take their fields positionally too, as DTensor's
# placements do: Shard(0), StridedShard(0, 2), Partial("sum").


@attrs.frozen
class Shard:
    """Chunk tensor dim ``dim`` over the axis like ``torch.chunk`` (uneven allowed)."""

    dim: int = attrs.field(validator=_check_dim)

    def __str__(self) -> str:
        return f"S({self.dim})"


@attrs.frozen
class StridedShard:
    """Cut dim ``dim`` into ``split_factor`` blocks, chunk each over the axis, and give
    rank ``i`` the concatenation of every block's ``i``-th chunk.

    This is DTensor's ``_StridedShard``: what FSDP2 produces on a dim that TP already
    shards, and what Megatron's per-rank ``[gate_r; up_r]`` is (``split_factor=2``).
    """

    dim: int = attrs.field(validator=_check_dim)
    split_factor: int = attrs.field(validator=_check_split_factor)

    def __str__(self) -> str:
        return f"SS({self.dim},{self.split_factor})"


@attrs.frozen
class Partial:
    """Every rank along the axis holds a partial value; the full value is ``op`` of them."""

    op: str = attrs.field(default="sum", validator=_check_op)

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Placement: TypeAlias = Replicate | Shard | StridedShard | Partial
PLACEMENT_TYPES = (Replicate, Shard, StridedShard, Partial)


def is_shard_like(p: Placement) -> bool:
    """True for ``Shard`` and ``StridedShard``."""
    return isinstance(p, (Shard, StridedShard))
