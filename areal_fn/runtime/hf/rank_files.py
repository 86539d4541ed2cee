"""What a per-rank file of :mod:`areal_fn.runtime.hf.convert` records about itself.

Each ``rank{r:05d}.safetensors`` carries, in its safetensors metadata, the allocation
it was written for (``allocation``) and a checksum of its tensors (``checksum``):
``blake3:<hex>`` of, for every tensor in name order, ``name``, ``0x00``, its torch
dtype (``torch.bfloat16``), ``0x00``, its shape (``(4, 32)``), ``0x00`` and its bytes
in memory order. The checksum covers what the file holds, not how the file lays it
out, so it is checked on the tensors as read back (:func:`check_digests`).
"""

from collections.abc import Mapping

import blake3
import torch

from areal_fn.errors import ConversionError
from areal_fn.strategy.allocation import Allocation
from areal_fn.strategy.parse import parse_allocation

__all__ = [
    "CHECKSUM",
    "check_digests",
    "check_recorded",
    "describe_checks",
    "recorded_allocation",
    "tensors_digest",
]

#: The metadata key holding a rank file's checksum.
CHECKSUM = "checksum"


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """``blake3:<hex>`` of ``tensors`` (names, dtypes, shapes, bytes; see the module)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return f"blake3:{h.hexdigest()}"


def check_digests(
    metadata: Mapping[str, Mapping[str, str]], states: Mapping[str, Mapping[str, torch.Tensor]]
) -> tuple[str, ...]:
    """Check every file's recorded checksum against its tensors (``metadata`` and
    ``states`` keyed by file name); the files that record none, in order.

    Raises :class:`~areal_fn.errors.ConversionError` naming the files that differ.
    """
    bad, unrecorded = [], []
    for name in sorted(states):
        want = metadata[name].get(CHECKSUM)
        if want is None:
            unrecorded.append(name)
        elif tensors_digest(states[name]) != want:
            bad.append(name)
    if bad:
        raise ConversionError(
            f"{', '.join(bad)}: the tensors do not match the checksum recorded when the file "
            "was written; the file was changed or damaged since: convert it again"
        )
    return tuple(unrecorded)


def recorded_allocation(metadata: Mapping[str, Mapping[str, str]], src: str) -> str:
    """The one allocation the files record; an error when they record none or several."""
    recorded = sorted({m.get("allocation") or "" for m in metadata.values()})
    if recorded == [""]:
        raise ConversionError(
            f"the rank files in {src} record no allocation (written for a layout); pass the "
            "allocation they were written for"
        )
    if len(recorded) != 1:
        shown = ", ".join(a or "none" for a in recorded)
        raise ConversionError(
            f"the rank files in {src} record several allocations ({shown}); they come from "
            "several conversions: convert again into one directory"
        )
    return recorded[0]


def check_recorded(
    metadata: Mapping[str, Mapping[str, str]], target: Allocation | str, src: str
) -> None:
    """One short line when the files record one allocation and ``target`` is another."""
    recorded = {m.get("allocation") or "" for m in metadata.values()} - {""}
    if len(recorded) != 1:
        return
    (said,) = recorded
    given = str(parse_allocation(target) if isinstance(target, str) else target)
    if said != given:
        raise ConversionError(
            f"the rank files in {src} were written for {said}, not {given}; pass {said}, or "
            "leave the allocation out (it is read from the files)"
        )


def describe_checks(verified: tuple[str, ...], unverified: tuple[str, ...]) -> str:
    """``; checksums of N rank file(s) verified`` and the files that recorded none."""
    text = f"; checksums of {len(verified)} rank file(s) verified" if verified else ""
    if unverified:
        text += f"; not verified (written without a checksum): {', '.join(unverified)}"
    return text
