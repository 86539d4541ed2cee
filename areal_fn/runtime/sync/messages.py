"""Sync messages: what one rank sends one peer in one bucket, packed into one buffer.

**Wire format.** Per bucket, a rank packs everything it sends to one peer, in plan
order, into one contiguous byte buffer: a 48-byte header (magic, version, bucket
index, payload size, a digest of the transfers, a digest of their dtypes) followed by
each transfer's box, 8-byte aligned (:func:`~areal_fn.plans.transfer_apply.pack_boxes`;
the receiver unpacks with :func:`~areal_fn.plans.transfer_apply.unpack_boxes`). The
receiver derives the same order and offsets from the same plan, so no other metadata
travels; the header turns a disagreement (another version, another plan, other
dtypes) into an error instead of wrong weights. Point-to-point operations are posted
pair by pair, the lower rank's message first, so that backends whose operations
rendezvous per pair (NCCL) cannot deadlock.
"""

import time
import zlib
from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.distributed as dist

from areal_fn.plans.transfer import Transfer
from areal_fn.plans.transfer_apply import pack_boxes, unpack_boxes
from areal_fn.runtime.sync.group import SyncError, SyncGroup, _fail, _td

MAGIC = 0x5A5F_57E1_6875  # marks a weight-sync message
HEADER_WORDS = 6  # magic, version, bucket, payload bytes, plan digest, dtype digest
HEADER_BYTES = HEADER_WORDS * 8
ALIGN = 8


@attrs.frozen
class _Message:
    """Everything one rank sends one peer (or receives from it) in one bucket."""

    src: int
    dst: int
    transfers: tuple[Transfer, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    size: int  # bytes, header and padding included

    @property
    def payload(self) -> int:
        return sum(
            t.box.numel * d.itemsize for t, d in zip(self.transfers, self.dtypes, strict=True)
        )

    def tensors(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.canonical for t in self.transfers))

    def header(self, version: int, bucket: int) -> list[int]:
        return [
            MAGIC,
            version,
            bucket,
            self.size - HEADER_BYTES,
            zlib.crc32("\n".join(str(t) for t in self.transfers).encode()),
            zlib.crc32(",".join(str(d) for d in self.dtypes).encode()),
        ]

    def describe(self, me: int) -> str:
        peer = self.dst if self.src == me else self.src
        verb = f"sending to rank {peer}" if self.src == me else f"receiving from rank {peer}"
        return f"{verb} ({len(self.transfers)} transfers of {_names(self.tensors())})"


def _message(src: int, dst: int, transfers: list[Transfer], dtypes: list[torch.dtype]) -> _Message:
    offsets = []
    off = HEADER_BYTES
    for t, d in zip(transfers, dtypes, strict=True):
        off = -(-off // ALIGN) * ALIGN
        offsets.append(off)
        off += t.box.numel * d.itemsize
    return _Message(src, dst, tuple(transfers), tuple(dtypes), tuple(offsets), off)


def _names(tensors: Sequence[str]) -> str:
    shown = ", ".join(tensors[:4])
    return shown + (f" and {len(tensors) - 4} more" if len(tensors) > 4 else "")


def _order(me: int, m: _Message) -> tuple[int, int, int]:
    peer = m.dst if m.src == me else m.src
    return (min(me, peer), max(me, peer), m.src)


def _exchange(
    group: SyncGroup,
    seq: int,
    version: int,
    bucket: int,
    outgoing: list[_Message],
    incoming: list[_Message],
    src_tensors: Mapping[str, torch.Tensor],
    shadows: Mapping[str, torch.Tensor],
    device: torch.device,
    previous: list[tuple[_Message, torch.Tensor]],
) -> list[tuple[_Message, torch.Tensor]]:
    """Send and receive one bucket's messages; returns what arrived, headers checked.

    ``previous`` (the last bucket's arrivals) is unpacked into the shadows while this
    bucket's operations are in flight.
    """
    me = group.rank
    deadline = time.monotonic() + group.timeout_s
    pending: list[tuple[_Message, torch.Tensor, dist.Work]] = []
    current: _Message | None = None
    error: Exception | None = None
    try:
        pg = group.pg
        for m in sorted(outgoing + incoming, key=lambda m: _order(me, m)):
            current = m
            if m.src == me:
                buf = _pack(m, version, bucket, src_tensors, device)
                pending.append((m, buf, pg.send([buf], group.group_rank(m.dst), bucket)))
            else:
                buf = torch.empty(m.size, dtype=torch.uint8, device=device)
                pending.append((m, buf, pg.recv([buf], group.group_rank(m.src), bucket)))
        current = None
        for m, buf in previous:
            _scatter(m, buf, shadows)
        for m, _, work in pending:
            current = m
            work.wait(_td(max(deadline - time.monotonic(), 0.001)))
        for m, buf, _ in pending:
            if m.dst == me:
                current = m
                _check_header(m, version, bucket, buf)
    except Exception as e:  # the backends raise RuntimeError, DistBackendError, ...
        error = e
    if error is None:
        return [(m, buf) for m, buf, _ in pending if m.dst == me]
    # release every handle on the connections before dropping them
    pending.clear()
    pg = work = buf = None  # type: ignore[assignment]
    del pg, work, buf
    what = current.describe(me) if current is not None else "posting its messages"
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    reason = f"sync v{version} failed in bucket {bucket} on rank {me} {what}: {text}"
    first = _fail(group, seq, reason)
    if first != reason:
        reason += f"; the first failure: {first}"
    peer = None if current is None else (current.dst if current.src == me else current.src)
    raise SyncError(
        reason,
        version=version,
        bucket=bucket,
        peer=peer,
        tensors=current.tensors() if current is not None else (),
    ) from error


class _HeaderMismatch(RuntimeError):
    pass


def _pack(
    m: _Message,
    version: int,
    bucket: int,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    buf = torch.zeros(m.size, dtype=torch.uint8, device=device)
    header = torch.tensor(m.header(version, bucket), dtype=torch.int64)
    buf[:HEADER_BYTES].view(torch.int64).copy_(header)
    with torch.no_grad():
        pack_boxes(m.transfers, tensors, buf, offsets=m.offsets, dtypes=m.dtypes)
    return buf


def _check_header(m: _Message, version: int, bucket: int, buf: torch.Tensor) -> None:
    """Check the header of a received message against what this rank's plan expects."""
    got = buf[:HEADER_BYTES].view(torch.int64).tolist()
    want = m.header(version, bucket)
    if got[0] != MAGIC:
        raise _HeaderMismatch("the message has no sync header; is the peer running this sync?")
    if got[1] != want[1]:
        raise _HeaderMismatch(
            f"the sender syncs version {got[1]}, this rank expects version {want[1]}; both "
            "sides must bucket the same plan with the same version"
        )
    if got[2:5] != want[2:5]:
        raise _HeaderMismatch(
            "the sender's transfers differ from this rank's plan; both sides must compute the "
            "plan and its buckets from the same layouts, ranks and max_bytes"
        )
    if got[5] != want[5]:
        raise _HeaderMismatch(
            f"the sender's dtypes differ from this rank's ({sorted({str(d) for d in m.dtypes})}); "
            "pass the same wire_dtype on both sides"
        )


def _scatter(m: _Message, buf: torch.Tensor, shadows: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        unpack_boxes(m.transfers, buf, shadows, offsets=m.offsets, dtypes=m.dtypes)
