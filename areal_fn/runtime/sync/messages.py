"""Sync messages: what one rank sends one peer in one bucket, and how its bytes travel.

**Wire format.** Per bucket, everything a rank sends one peer, in plan order, is one
message: an 80-byte header (magic, version, bucket index, payload size, a digest of
the transfers, a digest of their dtypes, then a 32-byte MAC) followed by each
transfer's box, 8-byte aligned (:func:`~areal_fn.plans.transfer.apply.pack_boxes`; the
receiver unpacks with :func:`~areal_fn.plans.transfer.apply.unpack_boxes`). The
receiver derives the same order and offsets from the same plan, so no other metadata
travels; the header turns a disagreement (another version, another plan, other
dtypes) into an error instead of wrong weights.

**Operations.** A message travels as several point-to-point operations, split by the
plan alone so both ends split alike: each box of at least :data:`DIRECT_BYTES` on its
own, the small boxes and alignment gaps between them together, the header last. A
box on its own is sent straight from the source tensor and received straight into
the shadow where its region there is contiguous and of the wire dtype (no pack or
unpack copy); the rest goes through buffers the group keeps from sync to sync
(:class:`_Buffers`, already mapped memory). Point-to-point operations are posted pair
by pair, the lower rank's message first, so that backends whose operations rendezvous
per pair (NCCL) cannot deadlock.

**The MAC**, ``HMAC-SHA256`` under the group's session key over the first 48 bytes,
the sync, sender, receiver and the payload's GMAC
(:func:`~areal_fn.runtime.sync.auth.message_tag`), is checked before anything else the
header says is believed and before any staged byte is unpacked (while the next bucket
is in flight): a message from a process without the group's secret, or altered on the
way, is refused, and what it put in the shadows is never committed. The sender packs
and seals the next bucket's messages while the current one is in flight.
"""

import hmac
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import NoReturn

import attrs
import torch
import torch.distributed as dist

from areal_fn.plans.transfer import Transfer
from areal_fn.plans.transfer.apply import pack_boxes, unpack_boxes
from areal_fn.runtime.sync.auth import TAG_BYTES, message_tag, payload_view
from areal_fn.runtime.sync.group import SyncError, SyncGroup, _fail, _td
from areal_fn.runtime.sync.staging import _buffers

MAGIC = 0x5A5F_57E1_6875  # marks a weight-sync message
HEADER_WORDS = 6  # magic, version, bucket, payload bytes, plan digest, dtype digest
FIELD_BYTES = HEADER_WORDS * 8
HEADER_BYTES = FIELD_BYTES + TAG_BYTES  # the fields, then their MAC
ALIGN = 8
#: a box of at least this many bytes travels as an operation of its own, straight from
#: the source tensor and into the shadow where its region there is contiguous
DIRECT_BYTES = 1 << 18


@attrs.frozen
class _Message:
    """Everything one rank sends one peer (or receives from it) in one bucket."""

    src: int
    dst: int
    transfers: tuple[Transfer, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    size: int  # bytes, header and padding included
    #: how the bytes travel: (start, end, transfer index or -1), one operation each
    ops: tuple[tuple[int, int, int], ...] = ()

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
    # the header, each large box on its own, the small boxes and gaps between them
    # together: from the plan alone, so both ends split alike
    ops, cursor = [(0, HEADER_BYTES, -1)], HEADER_BYTES
    for i, (t, d, at) in enumerate(zip(transfers, dtypes, offsets, strict=True)):
        n = t.box.numel * d.itemsize
        if n >= DIRECT_BYTES:
            if at > cursor:
                ops.append((cursor, at, -1))
            ops.append((at, at + n, i))
            cursor = at + n
    if off > cursor:
        ops.append((cursor, off, -1))
    return _Message(src, dst, tuple(transfers), tuple(dtypes), tuple(offsets), off, tuple(ops))


#: A message that arrived in a bucket: (bucket, message, its buffer, its payload's
#: segments in order, the transfers that landed in the shadows directly).
_Arrival = tuple[int, _Message, torch.Tensor, list[torch.Tensor], frozenset[int]]
#: A message sealed to send: (its buffer, its payload's segments in order).
_Sealed = tuple[torch.Tensor, list[torch.Tensor]]


def _direct(
    m: _Message, tensors: Mapping[str, torch.Tensor], *, source: bool
) -> dict[int, torch.Tensor]:
    """The large boxes of ``m`` whose region in ``tensors`` (the sources, else the
    shadows) is contiguous and of the wire dtype: their bytes, by transfer index."""
    out = {}
    for _, _, i in m.ops:
        if i < 0:
            continue
        t = m.transfers[i]
        whole = tensors[t.src_tensor if source else t.dst_tensor]
        region = whole[(t.src_box if source else t.dst_box).slices()]
        if whole.dtype == m.dtypes[i] and region.dim() > 0 and region.is_contiguous():
            out[i] = region.detach().reshape(-1).view(torch.uint8)
    return out


def _segments(
    m: _Message, buf: torch.Tensor, direct: Mapping[int, torch.Tensor]
) -> list[torch.Tensor]:
    """The payload operations' bytes in order: direct boxes, else spans of ``buf``."""
    return [direct[i] if i in direct else buf[lo:hi] for lo, hi, i in m.ops[1:]]


def _names(tensors: Sequence[str]) -> str:
    shown = ", ".join(tensors[:4])
    return shown + (f" and {len(tensors) - 4} more" if len(tensors) > 4 else "")


def _order(me: int, m: _Message) -> tuple[int, int, int]:
    peer = m.dst if m.src == me else m.src
    return (min(me, peer), max(me, peer), m.src)


#: What a rank sends in its next bucket: (bucket, messages, buffer slot).
_Ahead = tuple[int, list[_Message], int]


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
    slot: int = 0,
    packed: Mapping[int, _Sealed] | None = None,
    ahead: _Ahead | None = None,
) -> tuple[list[_Arrival], dict[int, _Sealed]]:
    """Send and receive one bucket's messages; returns what arrived, not yet checked,
    and the sealed messages of the next bucket (``ahead``), by receiver.

    Buffers come from the group's staging memory under ``slot`` (alternate it from
    bucket to bucket: arrivals stay in theirs until the next bucket has checked them).
    ``packed`` holds this bucket's messages sealed during the bucket before (any
    missing is packed here).

    While this bucket's operations are in flight, ``previous`` (the last bucket's
    arrivals) is checked (its MAC, then its header against the plan) and unpacked into
    the shadows, and the next bucket's messages are packed and sealed, so that copies
    and hashing overlap the transfers. With no messages, this checks and unpacks
    ``previous`` alone (after the last bucket).
    """
    me = group.rank
    deadline = time.monotonic() + group.timeout_s
    pending: list[_Pending] = []
    nxt: dict[int, _Sealed] = {}
    current: _Message | None = None
    at = bucket  # the bucket of the message ``current``
    error: Exception | None = None
    try:
        for m in sorted(outgoing + incoming, key=lambda m: _order(me, m)):
            current = m
            sealed = None
            if m.src == me:
                sealed = (packed or {}).get(m.dst) or _sealed(
                    group, seq, version, bucket, [m], src_tensors, device, slot
                )[m.dst]
            pending.append(_post(group, m, bucket, slot, shadows, device, sealed))
        current = None
        for at, current, buf, segments, direct in previous:
            _check_header(current, version, at, buf, group._session, seq, payload=segments)
            _scatter(current, buf, shadows, skip=direct)
        current = None
        if ahead is not None:
            at = ahead[0]
            nxt = _sealed(group, seq, version, *ahead[:2], src_tensors, device, ahead[2])
        at = bucket
        for m, _, _, _, works in pending:
            current = m
            for work in works:
                work.wait(_td(max(deadline - time.monotonic(), 0.001)))
    except Exception as e:  # the backends raise RuntimeError, DistBackendError, ...
        error = e
    if error is None:
        return [(bucket, m, b, sg, d) for m, b, sg, d, _ in pending if m.dst == me], nxt
    # release every handle on the connections before dropping them
    pending.clear()
    buf = segments = works = work = None  # type: ignore[assignment]
    del buf, segments, works, work
    _failed(group, seq, version, at, current, error)


_Pending = tuple[_Message, torch.Tensor, list[torch.Tensor], frozenset[int], list[dist.Work]]


def _post(
    group: SyncGroup,
    m: _Message,
    bucket: int,
    slot: int,
    shadows: Mapping[str, torch.Tensor],
    device: torch.device,
    sealed: _Sealed | None,
) -> _Pending:
    """Post the operations of message ``m``: ``sealed`` (this rank sends it) or a
    receive into the shadows, where boxes fit there, and the group's buffers."""
    pg = group.pg
    if sealed is not None:
        buf, segments = sealed
        other, post, direct = group.group_rank(m.dst), pg.send, frozenset[int]()
    else:
        buf = _buffers(group).flat(("recv", m.src, slot), m.size, device)
        into = _direct(m, shadows, source=False)
        segments, direct = _segments(m, buf, into), frozenset(into)
        other, post = group.group_rank(m.src), pg.recv
    # the payload's operations, then the header; a pair's operations of one bucket
    # are all in flight at once, and of one bucket only: tags tell them apart
    base = (bucket % 1024) << 20
    works = [post([seg], other, base + k + 1) for k, seg in enumerate(segments)]
    works.append(post([buf[:HEADER_BYTES]], other, base))
    return (m, buf, segments, direct, works)


def _failed(
    group: SyncGroup,
    seq: int,
    version: int,
    at: int,
    current: _Message | None,
    error: Exception,
) -> NoReturn:
    """Publish ``abort`` with this rank's reason and raise its :class:`SyncError`."""
    me = group.rank
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


def _sealed(
    group: SyncGroup,
    seq: int,
    version: int,
    bucket: int,
    outgoing: list[_Message],
    src_tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    slot: int,
) -> dict[int, _Sealed]:
    """``outgoing`` sealed, by receiver: large contiguous boxes stay in the sources, the
    rest is packed into the group's send buffers of ``slot``."""
    staging, out = _buffers(group), {}
    for m in outgoing:
        buf = staging.flat(("send", m.dst, slot), m.size, device)
        direct = _direct(m, src_tensors, source=True)
        _pack(m, version, bucket, src_tensors, device, out=buf, skip=frozenset(direct))
        segments = _segments(m, buf, direct)
        _seal(m, buf, group._session, seq, payload=segments)
        out[m.dst] = (buf, segments)
    return out


class _HeaderMismatch(RuntimeError):
    pass


#: why a message that fails its MAC is refused (full and delta messages alike)
AUTH_FAILED = (
    "the message fails authentication: its MAC does not match this group's key over "
    "the header (version, bucket, sender, receiver, sync) and the payload's GMAC, "
    "so a process without the group's secret sent it, or its bytes were altered on "
    "the way. Refused before unpacking; live tensors keep the previous version. Give "
    "every member the same secret and keep other processes off the group's store and "
    "ports"
)


def _pack(
    m: _Message,
    version: int,
    bucket: int,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    out: torch.Tensor | None = None,
    skip: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """``m`` packed: its header fields, a zeroed MAC, its boxes, zeroed alignment gaps.

    Into ``out`` (``m.size`` bytes, e.g. a buffer kept from an earlier bucket), else
    into a new buffer; only the header and the gaps are written besides the boxes.
    The boxes of the transfers in ``skip`` (sent from where they are) are left out.
    """
    buf = torch.empty(m.size, dtype=torch.uint8, device=device) if out is None else out
    header = torch.tensor(m.header(version, bucket), dtype=torch.int64)
    buf[:FIELD_BYTES].view(torch.int64).copy_(header)
    buf[FIELD_BYTES:HEADER_BYTES].zero_()
    end = HEADER_BYTES
    for t, d, off in zip(m.transfers, m.dtypes, m.offsets, strict=True):
        if off > end:
            buf[end:off].zero_()
        end = off + t.box.numel * d.itemsize
    keep = [i for i in range(len(m.transfers)) if i not in skip]
    with torch.no_grad():
        pack_boxes(
            [m.transfers[i] for i in keep],
            tensors,
            buf,
            offsets=[m.offsets[i] for i in keep],
            dtypes=[m.dtypes[i] for i in keep],
        )
    return buf


def _tag(
    m: _Message, buf: torch.Tensor, key: bytes, seq: int, payload: list[torch.Tensor] | None
) -> bytes:
    """The MAC of a message: its header fields, the sync, both ends, the payload (its
    bytes in order: ``buf`` after the header, or the ``payload`` segments)."""
    return message_tag(
        key,
        seq=seq,
        src=m.src,
        dst=m.dst,
        header=payload_view(buf[:FIELD_BYTES]),
        payload=payload_view(buf[HEADER_BYTES:])
        if payload is None
        else [payload_view(p) for p in payload],
    )


def _seal(
    m: _Message,
    buf: torch.Tensor,
    key: bytes,
    seq: int,
    *,
    payload: list[torch.Tensor] | None = None,
) -> None:
    """Write the MAC of a packed message into its header."""
    tag = torch.frombuffer(bytearray(_tag(m, buf, key, seq, payload)), dtype=torch.uint8)
    buf[FIELD_BYTES:HEADER_BYTES].copy_(tag)


def _check_header(
    m: _Message,
    version: int,
    bucket: int,
    buf: torch.Tensor,
    key: bytes,
    seq: int,
    *,
    payload: list[torch.Tensor] | None = None,
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
        bytes(payload_view(buf[FIELD_BYTES:HEADER_BYTES])), _tag(m, buf, key, seq, payload)
    ):
        raise _HeaderMismatch(AUTH_FAILED)
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


def _scatter(
    m: _Message,
    buf: torch.Tensor,
    shadows: Mapping[str, torch.Tensor],
    skip: frozenset[int] = frozenset(),
) -> None:
    """Unpack ``m``'s boxes from ``buf`` into the shadows, but those in ``skip`` (which
    arrived there directly)."""
    keep = [i for i in range(len(m.transfers)) if i not in skip]
    with torch.no_grad():
        unpack_boxes(
            [m.transfers[i] for i in keep],
            buf,
            shadows,
            offsets=[m.offsets[i] for i in keep],
            dtypes=[m.dtypes[i] for i in keep],
        )
