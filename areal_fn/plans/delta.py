"""Delta weight sync, the pure part: which elements changed, and how to say so in fewest bytes.

Between two RL steps most weights do not change bitwise (an update below the wire
dtype's resolution rounds back to the same value). A delta sync sends, per bucket
message (what one source sends one destination in one bucket,
:mod:`areal_fn.runtime.sync.messages`), only the elements that changed since the
version the destination holds. The message's dense payload (its boxes packed in plan
order, :func:`~areal_fn.plans.transfer_apply.pack_boxes`) is read as ``n`` units of
``unit`` bytes (the greatest common divisor of its dtypes' sizes: the element size
when the message has one dtype); the **change mask** says which units differ bitwise
from the payload of the version before. One of three encodings then travels:

- ``DENSE``: the whole payload, ``n * unit`` bytes (a full sync of that message);
- ``BITMAP``: the mask as a bitmap (bit ``i % 8`` of byte ``i // 8`` is unit ``i``),
  padded to 8 bytes, then the changed units' values in order;
- ``RUNS``: the run count ``r`` (an ``int32`` pair ``(r, 0)``), the changed units as
  ``r`` runs, one ``int32`` pair (start, length) each, then their values in order.

:func:`choose_encoding` takes the smallest (ties to the lower :class:`Encoding`), a
function of the mask alone (of ``n``, the changed count ``k`` and the run count
``r``), so neither side needs to be told why. :func:`decode_delta` applied to the old
payload gives the new one bitwise (laws in ``tests/laws/test_delta.py``).

**What the source keeps.** To compute a mask, a source keeps the payload of every
message it sent in the last committed sync: :func:`delta_base_bytes` bytes per
source rank, that is its share of the plan's bytes across ranks
(:meth:`~areal_fn.plans.transfer.TransferPlan.send_bytes`) in the wire dtype, plus
the alignment gaps between boxes (under 8 bytes each). A destination keeps nothing
extra: its live tensors are the version it holds.
"""

import enum
import math
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Int, UInt8
from torch import Tensor

from areal_fn.errors import PlanError
from areal_fn.plans.transfer import BucketPlan
from areal_fn.typecheck import beartype

#: a flat byte buffer (a message's payload)
Bytes = UInt8[Tensor, "nbytes"]
#: which units of a payload changed
Mask = Bool[Tensor, "units"]
#: (start, length) rows of a mask's runs of changed units
Runs = Int[Tensor, "runs 2"]
#: the indices of the changed units, increasing
Index = Int[Tensor, "changed"]
#: the bytes of one run: an int32 start and an int32 length
RUN_BYTES = 8
#: a bitmap is padded to this many bytes, so that the values after it stay aligned
ALIGN = 8
#: the most units one message may hold (run starts and lengths are int32)
MAX_UNITS = (1 << 31) - 1
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Encoding(enum.IntEnum):
    """How a message's changes travel (the value goes in the message header)."""

    DENSE = 0
    BITMAP = 1
    RUNS = 2


def unit_of(itemsizes: Sequence[int]) -> int:
    """The unit a payload of these element sizes is compared in: their gcd (1 when empty)."""
    return math.gcd(*itemsizes) if itemsizes else 1


def _units(buf: Bytes, unit: int) -> Tensor:
    if unit not in _INT or buf.numel() % unit:
        raise PlanError(
            f"a delta payload of {buf.numel()} bytes cannot be read in units of {unit} bytes; "
            f"the unit must be one of {sorted(_INT)} and divide the payload"
        )
    return buf.view(_INT[unit])


@beartype
def change_mask(old: Bytes, new: Bytes, unit: int) -> Mask:
    """Which units of ``new`` differ bitwise from ``old`` (payloads of equal size)."""
    if old.numel() != new.numel():
        raise PlanError(
            f"the previous payload has {old.numel()} bytes and the new one {new.numel()}; a "
            "delta needs the same message in both versions (send this one dense)"
        )
    n = new.numel() // unit
    if n > MAX_UNITS:
        raise PlanError(
            f"a delta message of {n} units exceeds {MAX_UNITS} (int32 runs); use smaller buckets"
        )
    return _units(old, unit) != _units(new, unit)


def _starts(mask: Tensor) -> Tensor:
    """Where a run of changed units starts (a changed unit after an unchanged one)."""
    starts = mask.clone()
    starts[1:] &= ~mask[:-1]
    return starts


def runs_of(mask: Mask) -> Runs:
    """The runs of ``True`` in ``mask``: ``(start, length)`` rows, in order."""
    ends = mask.clone()
    ends[:-1] &= ~mask[1:]
    first = torch.nonzero(_starts(mask)).flatten()
    last = torch.nonzero(ends).flatten()
    return torch.stack([first, last - first + 1], dim=1).to(torch.int32)


def encoded_sizes(n: int, k: int, r: int, unit: int) -> dict[Encoding, int]:
    """Bytes of each encoding for ``n`` units of ``unit`` bytes, ``k`` changed in ``r`` runs."""
    return {
        Encoding.DENSE: n * unit,
        Encoding.BITMAP: _bitmap_bytes(n) + k * unit,
        Encoding.RUNS: (r + 1) * RUN_BYTES + k * unit,
    }


@beartype
def choose_encoding(mask: Mask, unit: int) -> Encoding:
    """The smallest encoding of ``mask``'s changes (ties to the lower :class:`Encoding`)."""
    k, r = int(torch.count_nonzero(mask)), int(torch.count_nonzero(_starts(mask)))
    sizes = encoded_sizes(mask.numel(), k, r, unit)
    return min(sizes, key=lambda e: (sizes[e], e))


def _bitmap_bytes(n: int) -> int:
    """Bytes of the bitmap of ``n`` units, padded to :data:`ALIGN`."""
    return -(-n // (8 * ALIGN)) * ALIGN


def _bitmap(mask: Tensor) -> Tensor:
    n = mask.numel()
    padded = _bitmap_bytes(n) * 8
    bits = torch.zeros(padded, dtype=torch.uint8)
    bits[:n] = mask.to(torch.uint8)
    grouped = bits.view(-1, 8)
    out = grouped[:, 0].clone()
    for i in range(1, 8):
        out |= grouped[:, i] << i
    return out


def _unbitmap(bitmap: Tensor, n: int) -> Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((bitmap.view(-1, 1) >> shifts) & 1).flatten()[:n].bool()


@beartype
def encode_delta(
    old: Bytes, new: Bytes, unit: int, *, encoding: Encoding | None = None
) -> tuple[Encoding, Bytes]:
    """``new`` as a delta against ``old``: (encoding, bytes), in the smallest encoding
    (:func:`choose_encoding`) unless ``encoding`` is given."""
    mask = change_mask(old, new, unit)
    if encoding is None:
        encoding = choose_encoding(mask, unit)
    if encoding is Encoding.DENSE:
        return encoding, new.clone()
    values = _units(new, unit)[mask].view(torch.uint8)
    if encoding is Encoding.BITMAP:
        return encoding, torch.cat([_bitmap(mask), values])
    runs = runs_of(mask)
    count = torch.tensor([runs.shape[0], 0], dtype=torch.int32)
    return encoding, torch.cat([torch.cat([count, runs.reshape(-1)]).view(torch.uint8), values])


@beartype
def delta_changes(
    encoding: Encoding, payload: Bytes, *, nbytes: int, unit: int
) -> tuple[Index, Tensor]:
    """The changed units' indices (increasing) and values (as ``unit``-byte integers) of an
    encoded delta for a dense payload of ``nbytes``; a payload that is not a well-formed
    encoding of that size is a ``PlanError``."""
    n = nbytes // unit
    if encoding is Encoding.DENSE:
        _expect(payload.numel() == nbytes, f"{payload.numel()} bytes, dense needs {nbytes}")
        return torch.arange(n), _units(payload, unit)
    if encoding is Encoding.BITMAP:
        head = _bitmap_bytes(n)
        _expect(payload.numel() >= head, f"{payload.numel()} bytes, the bitmap alone is {head}")
        index = torch.nonzero(_unbitmap(payload[:head], n)).flatten()
        rest = payload[head:]
    else:
        _expect(payload.numel() >= RUN_BYTES, f"{payload.numel()} bytes, no run count")
        count = int(payload[:RUN_BYTES].view(torch.int32)[0])
        end = (count + 1) * RUN_BYTES
        _expect(0 <= count and end <= payload.numel(), f"{count} runs in {payload.numel()} bytes")
        runs = payload[RUN_BYTES:end].view(torch.int32).view(-1, 2).to(torch.int64)
        index = _run_indices(runs, n)
        rest = payload[end:]
    _expect(
        rest.numel() == index.numel() * unit,
        f"{rest.numel()} bytes of values for {index.numel()} changed units of {unit} bytes",
    )
    return index, _units(rest, unit)


def _run_indices(runs: Tensor, n: int) -> Tensor:
    starts, lengths = runs[:, 0], runs[:, 1]
    ends = starts + lengths
    ok = bool((lengths > 0).all()) and bool((starts >= 0).all()) and bool((ends <= n).all())
    ok = ok and bool((starts[1:] > ends[:-1]).all())
    _expect(ok, f"runs that are not increasing, disjoint and within {n} units")
    k = int(lengths.sum())
    first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
    return torch.arange(k) + first


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise PlanError(f"a malformed delta payload: {what}")


@beartype
def decode_delta(old: Bytes, encoding: Encoding, payload: Bytes, unit: int) -> Bytes:
    """The new payload: ``old`` with the changes ``payload`` encodes (a new tensor)."""
    index, values = delta_changes(encoding, payload, nbytes=old.numel(), unit=unit)
    out = old.clone()
    _units(out, unit)[index] = values
    return out


@beartype
def delta_base_bytes(plan: BucketPlan, rank: int, *, itemsize: int | None = None) -> int:
    """Bytes source ``rank`` keeps between syncs for delta syncs of ``plan``: the payload
    of every message it sends (transfers to other ranks), alignment gaps included;
    ``itemsize`` is the wire dtype's size when a wire dtype casts (default: the plan's)."""
    per_peer: dict[tuple[int, int], int] = {}
    for b in plan.buckets:
        for t in b.transfers:
            if t.src != rank or t.is_local:
                continue
            size = t.nbytes // max(1, t.box.numel) if itemsize is None else itemsize
            at = per_peer.get((b.index, t.dst), 0)
            per_peer[(b.index, t.dst)] = -(-at // ALIGN) * ALIGN + t.box.numel * size
    return sum(per_peer.values())


@beartype
def apply_delta(base: Bytes, encoding: Encoding, payload: Bytes, unit: int) -> None:
    """Write the changes ``payload`` encodes into ``base`` (in place): ``base`` becomes the
    new payload, as :func:`decode_delta` returns it."""
    index, values = delta_changes(encoding, payload, nbytes=base.numel(), unit=unit)
    _units(base, unit)[index] = values
