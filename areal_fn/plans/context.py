"""Context parallelism's split of a sequence: Megatron's load-balanced ``2 * cp`` chunks.

A row of ``T`` tokens is cut into ``2 * cp`` equal chunks; context-parallel rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (Megatron-Core's ``get_batch_on_this_cp_rank``),
so that under a causal mask every rank has the same attention work. All-gathering the
ranks' tokens gives the chunks in the order ``0, 2cp-1, 1, 2cp-2, ...``;
:func:`context_gather_order` puts them back in sequence order.

Pure: no tensors, no process groups.
"""

from areal_fn.errors import PlanError
from areal_fn.strategy.rows import check_context_split
from areal_fn.typecheck import beartype

__all__ = ["check_context_split", "context_chunks", "context_gather_order"]


@beartype
def context_chunks(seq_len: int, *, cp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The token ranges ``[lo, hi)`` of the row that context-parallel ``rank`` holds, in
    the order it holds them: chunk ``rank``, then chunk ``2 * cp - 1 - rank``.

    ``cp = 1``: the whole row. Refuses a length that does not cut into ``2 * cp`` chunks.
    """
    check_context_split(seq_len, cp)
    if cp == 1:
        return ((0, seq_len),)
    if not 0 <= rank < cp:
        raise PlanError(f"rank={rank} must lie in 0..{cp - 1} (cp={cp})")
    size = seq_len // (2 * cp)
    return tuple((c * size, (c + 1) * size) for c in (rank, 2 * cp - 1 - rank))


@beartype
def context_gather_order(cp: int) -> tuple[int, ...]:
    """For each chunk of the row in sequence order, its index among the ``2 * cp``
    chunks of an all-gather over the context-parallel ranks (rank-major, each rank's
    two chunks in the order it holds them)."""
    if cp < 1:
        raise PlanError(f"cp={cp} must be >= 1")
    return tuple(2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp))
