"""Packing variable-length sequences into rows under a token budget.

A packing plan is data: ``pack_sequences(lengths, max_tokens)`` says which sequences
share a row. Engines build each row by concatenating its sequences (positions restart
per sequence, attention stays inside a sequence) and pad the row to a multiple of
``multiple_of`` tokens with masked tokens, which the budget already counts.
"""

from collections.abc import Sequence

from areal_fn.errors import PlanError
from areal_fn.typecheck import beartype

__all__ = ["pack_sequences", "padded_row_length"]


def _check(lengths: Sequence[int], max_tokens: int, multiple_of: int) -> None:
    if multiple_of < 1:
        raise PlanError(f"multiple_of={multiple_of} must be >= 1; pass 1 for no row padding")
    if max_tokens < 1 or max_tokens % multiple_of:
        raise PlanError(
            f"max_tokens={max_tokens} must be a positive multiple of multiple_of={multiple_of} "
            f"(rows are padded to multiples of {multiple_of}); use a budget such as "
            f"{max(multiple_of, max_tokens - max_tokens % multiple_of)}"
        )
    for i, n in enumerate(lengths):
        if n < 1:
            raise PlanError(f"sequence {i} has length {n}; every sequence needs at least 1 token")
        if n > max_tokens:
            raise PlanError(
                f"sequence {i} has {n} tokens, more than max_tokens={max_tokens}; a sequence "
                "is never split or truncated: raise max_tokens_per_micro_batch to at least "
                f"{-(-n // multiple_of) * multiple_of}"
            )


@beartype
def pack_sequences(
    lengths: Sequence[int], max_tokens: int, *, multiple_of: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Rows of sequence indices whose lengths, padded to ``multiple_of``, fit ``max_tokens``.

    First-fit decreasing: sequences are taken longest first (ties by index) and each goes
    into the first row with room, else opens a new row. Within a row indices ascend;
    rows are ordered by their first index. Every index appears exactly once. Because
    ``max_tokens`` is a multiple of ``multiple_of``, a row whose lengths sum to at most
    ``max_tokens`` still fits once padded. Deterministic; refuses (never truncates) a
    sequence longer than the budget.
    """
    _check(lengths, max_tokens, multiple_of)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for r, u in enumerate(used):
            if u + lengths[i] <= max_tokens:
                rows[r].append(i)
                used[r] += lengths[i]
                break
        else:
            rows.append([i])
            used.append(lengths[i])
    return tuple(sorted(tuple(sorted(row)) for row in rows))


@beartype
def padded_row_length(lengths: Sequence[int], row: Sequence[int], *, multiple_of: int = 1) -> int:
    """Tokens in ``row`` once padded to a multiple of ``multiple_of``."""
    if multiple_of < 1:
        raise PlanError(f"multiple_of={multiple_of} must be >= 1; pass 1 for no row padding")
    total = sum(lengths[i] for i in row)
    return -(-total // multiple_of) * multiple_of
