"""How the training engines split a row of tokens under ``c``, as checks.

Megatron's context parallelism cuts a row into ``2 * cp`` equal chunks (rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r``; :mod:`areal_fn.plans.context`); FSDP2's
Ulysses sequence parallelism cuts it into ``cp`` equal parts. Pure.
"""

from areal_fn.errors import LayoutError, PlanError
from areal_fn.strategy.allocation import Backend, Component
from areal_fn.typecheck import beartype

__all__ = ["check_context_split", "check_rows"]


@beartype
def check_context_split(seq_len: int, cp: int) -> None:
    """Raise ``PlanError`` unless ``seq_len`` tokens cut into ``2 * cp`` equal chunks
    (``cp = 1``: any length >= 1)."""
    if cp < 1:
        raise PlanError(f"cp={cp} must be >= 1")
    if seq_len < 1:
        raise PlanError(f"sequence length {seq_len} must be >= 1")
    if cp > 1 and seq_len % (2 * cp):
        multiple = 2 * cp
        up = -(-seq_len // multiple) * multiple
        raise PlanError(
            f"sequence length {seq_len} does not split into 2*cp={multiple} equal chunks "
            f"(context parallelism gives rank r chunks r and {multiple - 1}-r); pass rows of a "
            f"multiple of {multiple} tokens (e.g. {up}, the extra tokens masked), or pack "
            "sequences (packed rows are padded to that multiple)"
        )


@beartype
def check_rows(component: Component, seq_len: int) -> None:
    """Raise ``LayoutError`` unless rows of ``seq_len`` tokens split as ``component``'s
    engine splits them: Megatron context parallelism cuts a row into ``2 * cp`` equal
    chunks, FSDP2's Ulysses sequence parallelism into ``cp`` equal parts."""
    cp = component.dims.cp
    if seq_len < 1:
        raise LayoutError(f"sequence length {seq_len} must be >= 1")
    if cp == 1 or not component.is_training:
        return
    if component.backend is Backend.MEGATRON:
        try:
            check_context_split(seq_len, cp)
        except PlanError as e:
            raise LayoutError(f"{component.label} ({component}): {e}") from None
    elif seq_len % cp:
        up = -(-seq_len // cp) * cp
        raise LayoutError(
            f"{component.label} ({component}): sequence length {seq_len} does not split into "
            f"cp={cp} equal parts (Ulysses sequence parallelism gives each rank of a "
            f"sequence-parallel group T/cp tokens); pass rows of a multiple of {cp} tokens "
            f"(e.g. {up}, the extra tokens masked), or pack sequences (packed rows are padded "
            "to that multiple)"
        )
