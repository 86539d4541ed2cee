"""Delta weight sync, the pure part: which elements changed, and how to say so in fewest bytes.

Between two RL steps most weights do not change bitwise (an update below the wire
dtype's resolution rounds back to the same value). A delta sync sends, per bucket
message (what one source sends one destination in one bucket,
:mod:`areal_fn.runtime.sync.messages`), only the elements that changed since the
version the destination holds. The message's dense payload (its boxes packed in plan
order, :func:`~areal_fn.plans.transfer.apply.pack_boxes`) is read as ``n`` units of
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

import numpy as np
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
_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class Encoding(enum.IntEnum):
    """How a message's changes travel (the value goes in the message header)."""

    DENSE = 0
    BITMAP = 1
    RUNS = 2


def unit_of(itemsizes: Sequence[int]) -> int:
    """The unit a payload of these element sizes is compared in: their gcd (1 when empty)."""
    return math.gcd(*itemsizes) if itemsizes else 1


def _check_units(buf: Tensor, unit: int) -> None:
    if unit not in _INT or buf.numel() % unit:
        raise PlanError(
            f"a delta payload of {buf.numel()} bytes cannot be read in units of {unit} bytes; "
            f"the unit must be one of {sorted(_INT)} and divide the payload"
        )


def _units(buf: Bytes, unit: int) -> Tensor:
    _check_units(buf, unit)
    return buf.view(_INT[unit])


def _np(buf: Tensor, unit: int = 1) -> np.ndarray:
    """``buf``'s bytes as a NumPy array of ``unit``-byte integers (no copy on the CPU)."""
    _check_units(buf, unit)
    return buf.detach().cpu().numpy().view(_NP[unit])


def _tensor(a: np.ndarray, like: Tensor) -> Tensor:
    return torch.from_numpy(a).to(like.device)


@beartype
def change_mask(old: Bytes, new: Bytes, unit: int) -> Mask:
    """Which units of ``new`` differ bitwise from ``old`` (payloads of equal size)."""
    return _tensor(_mask(old, new, unit), new)


def _mask(old: Tensor, new: Tensor, unit: int) -> np.ndarray:
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
    return np.not_equal(_np(old, unit), _np(new, unit))


def _counts(m: np.ndarray) -> tuple[int, int]:
    """(changed units, runs of them) in mask ``m``."""
    if not m.size:
        return 0, 0
    starts = int(m[0]) + int(np.count_nonzero(m[1:] & ~m[:-1]))
    return int(np.count_nonzero(m)), starts


def runs_of(mask: Mask) -> Runs:
    """The runs of ``True`` in ``mask``: ``(start, length)`` rows, in order."""
    return _tensor(_runs(mask.cpu().numpy()), mask)


def _runs(m: np.ndarray) -> np.ndarray:
    edge = np.diff(m.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    first, end = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    return np.stack([first, end - first], axis=1).astype(np.int32)


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
    return _choose(mask.cpu().numpy(), unit)


def _choose(m: np.ndarray, unit: int) -> Encoding:
    sizes = encoded_sizes(m.size, *_counts(m), unit)
    return min(sizes, key=lambda e: (sizes[e], e))


def _bitmap_bytes(n: int) -> int:
    """Bytes of the bitmap of ``n`` units, padded to :data:`ALIGN`."""
    return -(-n // (8 * ALIGN)) * ALIGN


@beartype
def encode_delta(
    old: Bytes, new: Bytes, unit: int, *, encoding: Encoding | None = None
) -> tuple[Encoding, Bytes]:
    """``new`` as a delta against ``old``: (encoding, bytes), in the smallest encoding
    (:func:`choose_encoding`) unless ``encoding`` is given."""
    encoding, payload, _, _ = encode_changes(old, new, unit, encoding=encoding)
    return encoding, payload


@beartype
def encode_changes(
    old: Bytes, new: Bytes, unit: int, *, encoding: Encoding | None = None
) -> tuple[Encoding, Bytes, Index, Tensor]:
    """:func:`encode_delta`, with the changed units' indices and values: ``old`` with
    ``values`` written at ``index`` (in units) is ``new``, whatever the encoding."""
    m = _mask(old, new, unit)
    index = np.flatnonzero(m)
    values = _np(new, unit).take(index)
    breaks = np.flatnonzero(np.diff(index) != 1) + 1  # where a run starts, but the first
    if encoding is None:
        r = breaks.size + 1 if index.size else 0
        sizes = encoded_sizes(m.size, index.size, r, unit)
        encoding = min(sizes, key=lambda e: (sizes[e], e))
    if encoding is Encoding.DENSE:
        payload = new.clone()
    elif encoding is Encoding.BITMAP:
        bitmap = np.zeros(_bitmap_bytes(m.size), dtype=np.uint8)
        packed = np.packbits(m, bitorder="little")
        bitmap[: packed.size] = packed
        payload = _tensor(np.concatenate([bitmap, values.view(np.uint8)]), new)
    else:
        first = index[np.concatenate([[0], breaks])] if index.size else index
        last = index[np.concatenate([breaks - 1, [index.size - 1]])] if index.size else index
        runs = np.stack([first, last - first + 1], axis=1).astype(np.int32)
        head = np.concatenate([np.array([runs.shape[0], 0], dtype=np.int32), runs.reshape(-1)])
        payload = _tensor(np.concatenate([head.view(np.uint8), values.view(np.uint8)]), new)
    return encoding, payload, _tensor(index, new), _tensor(values, new)


@beartype
def delta_changes(
    encoding: Encoding, payload: Bytes, *, nbytes: int, unit: int
) -> tuple[Index, Tensor]:
    """The changed units' indices (increasing) and values (as ``unit``-byte integers) of an
    encoded delta for a dense payload of ``nbytes``; a payload that is not a well-formed
    encoding of that size is a ``PlanError``."""
    n = nbytes // unit
    raw = _np(payload)
    if encoding is Encoding.DENSE:
        _expect(raw.size == nbytes, f"{raw.size} bytes, dense needs {nbytes}")
        return torch.arange(n), _units(payload, unit)
    if encoding is Encoding.BITMAP:
        head = _bitmap_bytes(n)
        _expect(raw.size >= head, f"{raw.size} bytes, the bitmap alone is {head}")
        bits = np.unpackbits(raw[:head], count=n, bitorder="little").view(bool)
        index = np.flatnonzero(bits)
    else:
        _expect(raw.size >= RUN_BYTES, f"{raw.size} bytes, no run count")
        count = int(raw[:RUN_BYTES].view(np.int32)[0])
        head = (count + 1) * RUN_BYTES
        _expect(0 <= count and head <= raw.size, f"{count} runs in {raw.size} bytes")
        index = _run_indices(raw[RUN_BYTES:head].view(np.int32).reshape(-1, 2), n)
    rest = raw[head:]
    _expect(
        rest.size == index.size * unit,
        f"{rest.size} bytes of values for {index.size} changed units of {unit} bytes",
    )
    return _tensor(index.astype(np.int64), payload), _tensor(rest.view(_NP[unit]), payload)


def _run_indices(runs: np.ndarray, n: int) -> np.ndarray:
    starts, lengths = runs[:, 0].astype(np.int64), runs[:, 1].astype(np.int64)
    ends = starts + lengths
    ok = bool((lengths > 0).all() and (starts >= 0).all() and (ends <= n).all())
    ok = ok and bool((starts[1:] > ends[:-1]).all())
    _expect(ok, f"runs that are not increasing, disjoint and within {n} units")
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(first.size, dtype=np.int64) + first


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise PlanError(f"a malformed delta payload: {what}")


@beartype
def decode_delta(old: Bytes, encoding: Encoding, payload: Bytes, unit: int) -> Bytes:
    """The new payload: ``old`` with the changes ``payload`` encodes (a new tensor)."""
    out = old.clone()
    apply_delta(out, encoding, payload, unit)
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
    if encoding is Encoding.DENSE:
        base.copy_(payload)
    elif base.device.type == "cpu":  # NumPy's put is several times torch's here
        _np(base, unit)[index.numpy()] = _np(values.view(torch.uint8), unit)
    else:
        _units(base, unit)[index.to(base.device)] = values.to(base.device)
