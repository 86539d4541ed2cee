"""Delta syncs: each message carries only the elements changed since the version its
receiver holds (:mod:`areal_fn.plans.delta` says how they are encoded).

``send_and_receive(..., delta=state)`` runs a sync this way; every member of the group
passes a :class:`DeltaState` (each its own, kept from sync to sync), or none does.

**Which version.** At the start of a sync every rank that receives posts on the
group's store, signed (:func:`~areal_fn.runtime.sync.auth.sign`), the version its live
tensors hold (``state.holds``; none before its first sync, or after :meth:`DeltaState.forget`).
A source sends a message as a delta only when that claim equals the version of the
payload it kept for that message (the last committed sync's); anything else (no claim,
another version, a claim without the group's MAC, a message it did not send then, a
source that keeps nothing) goes dense, which is a full sync of that message. The
header says which: the encoding and the base version travel in it, under the MAC.

**Wire format.** A message is a 96-byte header (magic, version, bucket, encoded
payload size, the digests of the transfers and of their dtypes, the base version or
-1, the encoding, then the 32-byte MAC over those fields, the sync, both ends and the
payload's GMAC, as for full messages), then the encoded payload. The receiver reads
the header first, refuses a size above the message's dense payload, receives the
payload, then checks the MAC, the fields against its plan and claim, and the
encoding's structure before anything is staged. What it stages is small (the changed
units and their values); the vote and the commit are the full sync's, and only after
``commit`` are the changes written into the live tensors (and local copies made).

**Memory.** A source keeps the payload of every message it sent
(:func:`~areal_fn.plans.delta.delta_base_bytes`: its share of the plan's bytes, in the
wire dtype), updated in place at commit; ``DeltaState(keep_previous=False)`` keeps
nothing and sends every message dense. A destination keeps no shadow copy: it stages
only what arrives.
"""

import hmac
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import attrs
import numpy as np
import torch

from areal_fn.errors import PlanError
from areal_fn.plans.delta import Encoding, delta_changes, encode_changes, unit_of
from areal_fn.plans.transfer import Transfer
from areal_fn.plans.transfer.apply import copy_box, unpack_boxes
from areal_fn.runtime.sync.auth import TAG_BYTES, message_tag, payload_view, sign, verified
from areal_fn.runtime.sync.group import SyncGroup, _fail, _td
from areal_fn.runtime.sync.messages import (
    AUTH_FAILED,
    HEADER_BYTES,
    _failed,
    _HeaderMismatch,
    _Message,
    _order,
    _pack,
)
from areal_fn.runtime.sync.progress import _Progress
from areal_fn.runtime.sync.staging import _buffers

DELTA_MAGIC = 0x5A5F_57E1_6876  # marks a delta-sync message
DELTA_WORDS = 8
DELTA_FIELDS = DELTA_WORDS * 8
DELTA_HEADER = DELTA_FIELDS + TAG_BYTES
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaState:
    """What one rank keeps for delta syncs, from sync to sync (pass the same object).

    As a source: the payload of each message it sent in the last committed sync, and
    that sync's version (``keep_previous=False`` keeps none: every message goes dense
    and nothing is held). As a destination: ``holds``, the version its live tensors hold
    bitwise as a committed sync left them (``None``: none). Each committed sync updates
    both; a failed one changes neither. Call :meth:`forget` when the live tensors
    change outside a sync (the next sync is then full).
    """

    def __init__(self, *, keep_previous: bool = True, holds: int | None = None) -> None:
        self.keep_previous = keep_previous
        self.holds = holds
        self.base_version: int | None = None
        self._previous: dict[tuple[int, ...], torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"DeltaState(holds={self.holds}, base_version={self.base_version}, "
            f"kept_bytes={self.kept_bytes}, keep_previous={self.keep_previous})"
        )

    @property
    def kept_bytes(self) -> int:
        """Bytes this rank keeps as a source (the payloads it sent last)."""
        return sum(t.numel() for t in self._previous.values())

    def forget(self) -> None:
        """Drop what is kept: this rank holds no version and keeps no payload."""
        self.holds = None
        self.base_version = None
        self._previous = {}


@attrs.define
class DeltaStaged:
    """What a delta sync staged until the commit, and its byte counts."""

    #: (message, bucket, encoding, encoded payload) of every message this rank sent
    #: (message, bucket, the kept payload's changes (indices, values) or the new payload)
    sent: list[tuple[_Message, int, Any]] = attrs.Factory(list)
    #: (message, encoding, changed unit indices, values) of every message received
    arrived: list[tuple[_Message, Encoding, torch.Tensor, torch.Tensor]] = attrs.Factory(list)
    copies: list[Transfer] = attrs.Factory(list)
    sent_bytes: int = 0
    received_bytes: int = 0
    full_bytes: int = 0
    overhead: int = 0
    deltas: int = 0


#: a message that arrived: (bucket, message, header, payload), checked in the next bucket
_Arrived = tuple[int, _Message, torch.Tensor, torch.Tensor]


def _key(m: _Message, bucket: int) -> tuple[int, ...]:
    return (m.src, m.dst, *m.header(0, bucket)[2:])


def _unit(m: _Message) -> int:
    return unit_of([d.itemsize for d in m.dtypes])


def check_delta_tensors(
    steps: list[tuple[int, list[Transfer], list[_Message], list[_Message]]],
    dst_tensors: Mapping[str, torch.Tensor],
) -> None:
    """A delta writes wire units into the live tensors: their dtypes must be the wire's."""
    for _, _, _, incoming in steps:
        for m in incoming:
            for t, d in zip(m.transfers, m.dtypes, strict=True):
                have = dst_tensors[t.dst_tensor].dtype
                if have != d:
                    raise PlanError(
                        f"a delta sync writes {d} units into destination tensor "
                        f"{t.dst_tensor!r}, which is {have}; pass wire_dtype={have} or none, "
                        "or sync without delta="
                    )


def _claims(
    group: SyncGroup, seq: int, version: int, steps: list, state: "DeltaState"
) -> dict[int, int]:
    """Post this rank's held version (if it receives), read its receivers' claims."""
    me = group.rank
    receives = any(incoming for _, _, _, incoming in steps)
    peers = sorted({m.dst for _, _, outgoing, _ in steps for m in outgoing})
    try:
        if receives:
            held = -1 if state.holds is None else state.holds
            group.store.set(
                group._key(seq, f"holds/{me}"), sign(group._session, f"holds/{me}", seq, str(held))
            )
        keys = [group._key(seq, f"holds/{p}") for p in peers]
        if keys:
            group.store.wait(keys, _td(group.timeout_s))
        got = {p: group.store.get(k) for p, k in zip(peers, keys, strict=True)}
    except Exception as e:
        _failed(group, seq, version, -1, None, RuntimeError(f"no version claim arrived: {e}"))
    out = {}
    for p, value in got.items():
        text = verified(group._session, f"holds/{p}", seq, value)
        out[p] = -1 if text is None else int(text)  # an unsigned claim: dense
    return out


def run_delta_steps(
    group: SyncGroup,
    seq: int,
    version: int,
    steps: list,
    progress: _Progress,
    src_tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    on_bucket: Callable[[int], None] | None,
    state: DeltaState,
) -> DeltaStaged:
    """Every bucket of this rank, in order, as delta messages; what to commit."""
    claims = _claims(group, seq, version, steps, state)
    staged = DeltaStaged()
    arrived: list[_Arrived] = []
    for b, copies, outgoing, incoming in steps:
        progress.advance(b + 1, version)
        try:
            if on_bucket is not None:
                on_bucket(b)
        except Exception as e:
            _fail(
                group, seq, f"sync v{version} failed on rank {group.rank} before bucket {b}: {e!r}"
            )
            raise
        staged.copies += copies
        peers = sorted({m.dst for m in outgoing} | {m.src for m in incoming})
        progress.await_peers(peers, b, version)
        arrived = _exchange(
            group,
            seq,
            version,
            b,
            outgoing,
            incoming,
            src_tensors,
            device,
            claims,
            state,
            staged,
            arrived,
        )
    last = steps[-1][0] if steps else 0  # check the last bucket's arrivals
    _exchange(
        group, seq, version, last, [], [], src_tensors, device, claims, state, staged, arrived
    )
    return staged


def _encode(
    m: _Message,
    version: int,
    bucket: int,
    src_tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    group: SyncGroup,
    claim: int,
    state: DeltaState,
) -> tuple[Encoding, int, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(encoding, base version or -1, encoded payload, and for a message against a kept
    payload the changed units' indices and values) of outgoing message ``m``."""
    base = state._previous.get(_key(m, bucket)) if state.keep_previous else None
    payload_bytes = m.size - HEADER_BYTES
    if base is not None and claim == state.base_version and base.numel() == payload_bytes:
        buf = _buffers(group).flat(("send", m.dst, 0), m.size, device)
        _pack(m, version, bucket, src_tensors, device, out=buf)
        encoding, data, index, values = encode_changes(base, buf[HEADER_BYTES:], _unit(m))
        return encoding, claim, data, (index, values)
    if state.keep_previous:  # a fresh buffer: it becomes the kept payload at commit
        buf = torch.empty(m.size, dtype=torch.uint8, device=device)
    else:
        buf = _buffers(group).flat(("send", m.dst, 0), m.size, device)
    _pack(m, version, bucket, src_tensors, device, out=buf)
    return Encoding.DENSE, -1, buf[HEADER_BYTES:], None


def _header(
    group: SyncGroup,
    seq: int,
    version: int,
    bucket: int,
    m: _Message,
    enc: Encoding,
    base: int,
    data: torch.Tensor,
) -> torch.Tensor:
    """The header of a delta message, MAC included."""
    fields = m.header(version, bucket)
    fields[0], fields[3] = DELTA_MAGIC, data.numel()
    head = torch.zeros(DELTA_HEADER, dtype=torch.uint8)
    head[:DELTA_FIELDS].view(torch.int64).copy_(torch.tensor([*fields, base, int(enc)]))
    tag = _tag(group, seq, m, head, data)
    head[DELTA_FIELDS:] = torch.frombuffer(bytearray(tag), dtype=torch.uint8)
    return head


def _tag(group: SyncGroup, seq: int, m: _Message, head: torch.Tensor, data: torch.Tensor) -> bytes:
    return message_tag(
        group._session,
        seq=seq,
        src=m.src,
        dst=m.dst,
        header=payload_view(head[:DELTA_FIELDS]),
        payload=payload_view(data.cpu() if data.numel() else torch.zeros(0, dtype=torch.uint8)),
    )


def _exchange(
    group: SyncGroup,
    seq: int,
    version: int,
    bucket: int,
    outgoing: list[_Message],
    incoming: list[_Message],
    src_tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    claims: Mapping[int, int],
    state: DeltaState,
    staged: DeltaStaged,
    previous: "list[_Arrived]",
) -> "list[_Arrived]":
    """Send and receive one bucket's delta messages: headers first, then the payloads
    whose sizes the headers give; returns what arrived. ``previous`` (the bucket
    before's arrivals) is checked and staged while this bucket's headers travel."""
    me, pg = group.rank, group.pg
    deadline = time.monotonic() + group.timeout_s
    tag = (bucket % 1024) << 20
    current: _Message | None = None
    at = bucket  # the bucket of ``current``
    works: list = []
    heads: list[tuple[_Message, torch.Tensor]] = []
    try:
        for m in sorted(outgoing + incoming, key=lambda m: _order(me, m)):
            current = m
            if m.src == me:
                enc, base, data, changes = _encode(
                    m, version, bucket, src_tensors, device, group, claims.get(m.dst, -1), state
                )
                head = _header(group, seq, version, bucket, m, enc, base, data)
                works.append(pg.send([head.to(device)], group.group_rank(m.dst), tag))
                if data.numel():
                    works.append(pg.send([data], group.group_rank(m.dst), tag + 1))
                staged.sent.append((m, bucket, data if changes is None else changes))
                staged.sent_bytes += data.numel()
                staged.full_bytes += m.payload
                staged.overhead += DELTA_HEADER
                staged.deltas += enc is not Encoding.DENSE
            else:
                head = torch.empty(DELTA_HEADER, dtype=torch.uint8, device=device)
                heads.append((m, head))
                works.append(pg.recv([head], group.group_rank(m.src), tag))
        at = bucket
        for at, current, head, data in previous:
            _arrive(group, seq, version, at, current, head, data, state, staged)
        at, current = bucket, None
        for work in works:
            work.wait(_td(max(deadline - time.monotonic(), 0.001)))
        works, bodies = [], []
        for m, head in heads:
            current = m
            data = _payload_for(m, head, device)
            if data.numel():
                works.append(pg.recv([data], group.group_rank(m.src), tag + 1))
            bodies.append((m, head, data))
        for work in works:
            work.wait(_td(max(deadline - time.monotonic(), 0.001)))
        return [(bucket, m, head, data) for m, head, data in bodies]
    except Exception as e:  # the backends raise RuntimeError, DistBackendError, ...
        works.clear()
        _failed(group, seq, version, at, current, e)


def _payload_for(m: _Message, head: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A buffer for the payload a received header announces (at most the dense payload)."""
    fields = head[:DELTA_FIELDS].view(torch.int64).tolist()
    if fields[0] != DELTA_MAGIC:
        raise _HeaderMismatch(
            "the message has no delta-sync header; every member passes delta= or none does"
        )
    dense = m.size - HEADER_BYTES
    if not 0 <= fields[3] <= dense:
        raise _HeaderMismatch(
            f"the header announces {fields[3]} payload bytes, more than the message's "
            f"{dense} dense bytes (or fewer than 0); refused before receiving it"
        )
    return torch.empty(fields[3], dtype=torch.uint8, device=device)


def _arrive(
    group: SyncGroup,
    seq: int,
    version: int,
    bucket: int,
    m: _Message,
    head: torch.Tensor,
    data: torch.Tensor,
    state: DeltaState,
    staged: DeltaStaged,
) -> None:
    """Check a received delta message (its MAC, then its fields, then its encoding's
    structure) and stage its changes."""
    if not hmac.compare_digest(
        bytes(payload_view(head[DELTA_FIELDS:])), _tag(group, seq, m, head, data)
    ):
        raise _HeaderMismatch(AUTH_FAILED)
    got = head[:DELTA_FIELDS].view(torch.int64).tolist()
    want = m.header(version, bucket)
    if got[1] != want[1]:
        raise _HeaderMismatch(
            f"the sender syncs version {got[1]}, this rank expects version {want[1]}; both "
            "sides must bucket the same plan with the same version"
        )
    if got[2] != want[2] or got[4:6] != want[4:6]:
        raise _HeaderMismatch(
            "the sender's transfers or dtypes differ from this rank's plan; both sides must "
            "compute the plan and its buckets from the same layouts, ranks, max_bytes and wire_dtype"
        )
    base, enc = got[6], got[7]
    if enc not in {e.value for e in Encoding}:
        raise _HeaderMismatch(
            f"the header names encoding {enc}, not one of {[e.value for e in Encoding]}"
        )
    encoding = Encoding(enc)
    held = -1 if state.holds is None else state.holds
    if encoding is not Encoding.DENSE and base != held:
        raise _HeaderMismatch(
            f"the sender sent a delta against version {base}, but this rank holds "
            f"{'none' if state.holds is None else held}; a delta applies only to the version it was made from"
        )
    dense = m.size - HEADER_BYTES
    if encoding is Encoding.DENSE:  # the payload itself, written at commit
        if data.numel() != dense:
            raise _HeaderMismatch(f"a dense message of {data.numel()} bytes, not {dense}")
        staged.arrived.append((m, encoding, data[:0], data))
    else:
        try:
            index, values = delta_changes(encoding, data, nbytes=dense, unit=_unit(m))
        except PlanError as e:
            raise _HeaderMismatch(str(e)) from None
        staged.arrived.append((m, encoding, index, values))
    staged.received_bytes += data.numel()
    staged.full_bytes += m.payload
    staged.deltas += encoding is not Encoding.DENSE


def commit_delta(
    staged: DeltaStaged,
    version: int,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: MutableMapping[str, torch.Tensor],
    state: DeltaState,
) -> None:
    """After ``commit``: write the staged changes and local copies into the live tensors,
    keep what was sent as the next base, and record the versions."""
    with torch.no_grad():
        for m, encoding, index, values in staged.arrived:
            _write(m, encoding, index, values, dst_tensors)
        for t in staged.copies:
            copy_box(src_tensors[t.src_tensor], dst_tensors[t.dst_tensor], t)
    if staged.arrived or staged.copies:
        state.holds = version
    if not staged.sent:
        return
    if not state.keep_previous:
        state._previous, state.base_version = {}, None
        return
    kept: dict[tuple[int, ...], torch.Tensor] = {}
    for m, bucket, sent in staged.sent:
        key = _key(m, bucket)
        if isinstance(sent, torch.Tensor):  # a fresh dense payload
            kept[key] = sent
        else:  # the kept payload, changed where the new one differs
            base = state._previous[key]
            index, values = sent
            base.view(values.dtype)[index] = values
            kept[key] = base
    state._previous = kept
    state.base_version = version


def _write(
    m: _Message,
    encoding: Encoding,
    index: torch.Tensor,
    values: torch.Tensor,
    dst_tensors: MutableMapping[str, torch.Tensor],
) -> None:
    """Write one message's changed units into the live tensors (its boxes, in order)."""
    unit = _unit(m)
    if encoding is Encoding.DENSE:
        offsets = [o - HEADER_BYTES for o in m.offsets]
        unpack_boxes(
            m.transfers,
            values,
            dst_tensors,
            offsets=offsets,
            dtypes=list(m.dtypes),
        )
        return
    los = [(off - HEADER_BYTES) // unit for off in m.offsets]
    his = [
        lo + t.box.numel * d.itemsize // unit
        for t, d, lo in zip(m.transfers, m.dtypes, los, strict=True)
    ]
    cut = np.searchsorted(index.cpu().numpy(), np.array(los + his)).tolist()
    n = len(los)
    for i, t in enumerate(m.transfers):
        a, b = cut[i], cut[n + i]
        if a == b:
            continue
        region = dst_tensors[t.dst_tensor][t.dst_box.slices()]
        flat = region if region.is_contiguous() else region.contiguous()
        units = flat.reshape(-1).view(torch.uint8).view(_INT[unit])
        at, got = index[a:b] - los[i], values[a:b]
        if units.device.type == "cpu":  # NumPy's put is several times torch's here
            units.numpy()[at.numpy()] = got.numpy()
        else:
            units[at] = got
        if flat is not region:
            region.copy_(flat)
