"""Sync messages: what one rank sends one peer in one bucket, packed into one buffer.

**Wire format.** Per bucket, a rank packs everything it sends to one peer, in plan
order, into one contiguous byte buffer: an 80-byte header (magic, version, bucket
index, payload size, a digest of the transfers, a digest of their dtypes, then a
32-byte MAC) followed by each transfer's box, 8-byte aligned
(:func:`~areal_fn.plans.transfer_apply.pack_boxes`; the receiver unpacks with
:func:`~areal_fn.plans.transfer_apply.unpack_boxes`). The receiver derives the same
order and offsets from the same plan, so no other metadata travels; the header turns
a disagreement (another version, another plan, other dtypes) into an error instead of
wrong weights. The MAC, ``HMAC-SHA256`` under the group's session key over the first
48 bytes, the sync, sender, receiver and the payload's digest
(:func:`~areal_fn.runtime.sync.auth.message_tag`), is checked before anything else the
header says is believed and before any byte is unpacked (while the next bucket is in
flight): a message from a process without the group's secret, or altered on the way,
is refused. Point-to-point operations are posted pair by pair, the lower rank's
message first, so that backends whose operations rendezvous per pair (NCCL) cannot
deadlock.
"""

import hmac
import time
import zlib
from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.distributed as dist

from areal_fn.plans.transfer import Transfer
from areal_fn.plans.transfer_apply import pack_boxes, unpack_boxes
from areal_fn.runtime.sync.auth import TAG_BYTES, message_tag, payload_view
from areal_fn.runtime.sync.group import SyncError, SyncGroup, _fail, _td

MAGIC = 0x5A5F_57E1_6875  # marks a weight-sync message
HEADER_WORDS = 6  # magic, version, bucket, payload bytes, plan digest, dtype digest
FIELD_BYTES = HEADER_WORDS * 8
HEADER_BYTES = FIELD_BYTES + TAG_BYTES  # the fields, then their MAC
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


#: A message that arrived in a bucket: (bucket, message, its buffer).
_Arrival = tuple[int, _Message, torch.Tensor]


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
    previous: list[_Arrival],
) -> list[_Arrival]:
    """Send and receive one bucket's messages; returns what arrived, not yet checked.

    ``previous`` (the last bucket's arrivals) is checked (its MAC, then its header
    against the plan) and unpacked into the shadows while this bucket's operations are
    in flight, so that hashing overlaps the transfers. With no messages, this checks
    and unpacks ``previous`` alone (after the last bucket).
    """
    me = group.rank
    deadline = time.monotonic() + group.timeout_s
    pending: list[tuple[_Message, torch.Tensor, dist.Work]] = []
    current: _Message | None = None
    at = bucket  # the bucket of the message ``current``
    error: Exception | None = None
    try:
        pg = group.pg
        for m in sorted(outgoing + incoming, key=lambda m: _order(me, m)):
            current = m
            if m.src == me:
                buf = _pack(m, version, bucket, src_tensors, device)
                _seal(m, buf, group._session, seq)
                pending.append((m, buf, pg.send([buf], group.group_rank(m.dst), bucket)))
            else:
                buf = torch.empty(m.size, dtype=torch.uint8, device=device)
                pending.append((m, buf, pg.recv([buf], group.group_rank(m.src), bucket)))
        current = None
        for at, current, buf in previous:
            _check_header(current, version, at, buf, group._session, seq)
            _scatter(current, buf, shadows)
        current, at = None, bucket
        for m, _, work in pending:
            current = m
            work.wait(_td(max(deadline - time.monotonic(), 0.001)))
    except Exception as e:  # the backends raise RuntimeError, DistBackendError, ...
        error = e
    if error is None:
        return [(bucket, m, buf) for m, buf, _ in pending if m.dst == me]
    # release every handle on the connections before dropping them
    pending.clear()
    pg = work = buf = None  # type: ignore[assignment]
    del pg, work, buf
    what = current.describe(me) if current is not None else "posting its messages"
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    reason = f"sync v{version} failed in bucket {at} on rank {me} {what}: {text}"
    first = _fail(group, seq, reason)
    if first != reason:
        reason += f"; the first failure: {first}"
    peer = None if current is None else (current.dst if current.src == me else current.src)
    raise SyncError(
        reason,
        version=version,
        bucket=at,
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
    buf[:FIELD_BYTES].view(torch.int64).copy_(header)
    with torch.no_grad():
        pack_boxes(m.transfers, tensors, buf, offsets=m.offsets, dtypes=m.dtypes)
    return buf


def _tag(m: _Message, buf: torch.Tensor, key: bytes, seq: int) -> bytes:
    """The MAC of a packed message: its header fields, the sync, both ends, the payload."""
    return message_tag(
        key,
        seq=seq,
        src=m.src,
        dst=m.dst,
        header=payload_view(buf[:FIELD_BYTES]),
        payload=payload_view(buf[HEADER_BYTES:]),
    )


def _seal(m: _Message, buf: torch.Tensor, key: bytes, seq: int) -> None:
    """Write the MAC of a packed message into its header."""
    tag = torch.frombuffer(bytearray(_tag(m, buf, key, seq)), dtype=torch.uint8)
    buf[FIELD_BYTES:HEADER_BYTES].copy_(tag)


def _check_header(
    m: _Message, version: int, bucket: int, buf: torch.Tensor, key: bytes, seq: int
) -> None:
    """Check a received message's MAC, then its header against this rank's plan.

    A header whose payload size differs from the plan's is refused on that alone (the
    MAC cannot cover a span this rank did not receive); any other is authenticated
    before its fields are believed.
    """
    got = buf[:FIELD_BYTES].view(torch.int64).tolist()
    want = m.header(version, bucket)
    if got[0] != MAGIC:
        raise _HeaderMismatch("the message has no sync header; is the peer running this sync?")
    if got[3] == want[3] and not hmac.compare_digest(
        bytes(payload_view(buf[FIELD_BYTES:HEADER_BYTES])), _tag(m, buf, key, seq)
    ):
        raise _HeaderMismatch(
            "the message fails authentication: its MAC does not match this group's key over "
            "the header (version, bucket, sender, receiver, sync) and the payload's digest, "
            "so a process without the group's secret sent it, or its bytes were altered on "
            "the way. Refused before unpacking; live tensors keep the previous version. Give "
            "every member the same secret and keep other processes off the group's store and "
            "ports"
        )
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
