"""Weight sync: execute a :class:`~areal_fn.plans.transfer.BucketPlan` over a process group.

The plan is pure data computed identically on every rank
(:func:`~areal_fn.plans.transfer.plan_transfers` then :func:`~areal_fn.plans.transfer.bucket`);
this module only moves bytes::

    plan = bucket(plan_transfers(train, infer, src_ranks=[0, 1], dst_ranks=[2, 3]),
                  64 << 20, version=step)
    group = SyncGroup.from_world([0, 1, 2, 3], timeout_s=30)      # or SyncGroup.from_store
    report = send_and_receive(plan, src_tensors=mine, dst_tensors=live, group=group)

**Wire format.** Per bucket, a rank packs everything it sends to one peer, in plan
order, into one contiguous byte buffer: a 48-byte header (magic, version, bucket
index, payload size, a digest of the transfers, a digest of their dtypes) followed by
each transfer's box, 8-byte aligned. The receiver derives the same order and offsets
from the same plan, so no other metadata travels; the header turns a disagreement
(another version, another plan, other dtypes) into an error instead of wrong weights.
Transfers a rank makes to itself are local copies. Point-to-point operations are
posted pair by pair, the lower rank's message first, so that backends whose
operations rendezvous per pair (NCCL) cannot deadlock.

**Progress and timeouts.** Every member publishes on the group's store which bucket
it has started. A rank posts a bucket's operations only once the peers it exchanges
with in that bucket have started it, so ``timeout_s`` bounds one bucket's exchange
(not a peer's earlier buckets with other ranks); waits on the store time out only
after ``timeout_s`` without any progress.

**Atomicity.** Received boxes are staged in shadow buffers. After its last bucket a
rank votes on the store and waits until every member has voted; then one
``compare_set`` on the store decides, for everyone, ``commit`` or ``abort``. Only
after ``commit`` does a rank copy its shadows into its live tensors. A rank that
fails (a timeout, a peer's death, a header mismatch, a bad input) publishes ``abort``
with its reason and drops its connections, which fails its peers' pending operations
at once; every member then raises :class:`SyncError` (naming, where it knows them, the
bucket, the peer and the tensors, and the first failure's reason) and no live tensor
changes. The one way to end split: a rank that loses the store itself after the
others decided ``commit``; its error says so.

**Recovery.** A failed group is spent. :meth:`SyncGroup.renew` forms a fresh one under
the next generation of its store prefix, optionally over fewer members, after which
the next sync can succeed.
"""

import contextlib
import datetime
import time
import zlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Protocol, cast

import attrs
import torch
import torch.distributed as dist

from areal_fn.errors import PlanError
from areal_fn.plans.transfer import BucketPlan, Transfer
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

__all__ = ["SyncError", "SyncGroup", "SyncReport", "Transport", "open_store", "send_and_receive"]

MAGIC = 0x5A5F_57E1_6875  # marks a weight-sync message
HEADER_WORDS = 6  # magic, version, bucket, payload bytes, plan digest, dtype digest
HEADER_BYTES = HEADER_WORDS * 8
ALIGN = 8
COMMIT, ABORT = "commit", "abort"
_POLL_S = (0.0005, 0.02)  # first and longest pause while waiting for the vote


class SyncError(RuntimeError):
    """A sync failed; no live tensor of this rank changed.

    ``bucket``, ``peer`` (a plan rank) and ``tensors`` (canonical names) say where this
    rank saw the failure; they are ``None``/empty when it learnt of another member's
    failure at the vote. ``version`` is the plan's version.
    """

    def __init__(
        self,
        message: str,
        *,
        version: int,
        bucket: int | None = None,
        peer: int | None = None,
        tensors: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.version = version
        self.bucket = bucket
        self.peer = peer
        self.tensors = tensors


@attrs.frozen(kw_only=True)
class SyncReport:
    """What one rank did in one successful sync (bytes are payload bytes)."""

    version: int
    rank: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    #: headers and alignment padding sent, on top of ``bytes_sent``.
    overhead_bytes: int
    buckets: int
    messages: int
    seconds: float


# -- groups ----------------------------------------------------------------------------
class Transport(Protocol):
    """What a sync needs of a process group: point-to-point operations and abort."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work: ...

    def abort(self) -> None: ...


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@beartype
def open_store(
    host: str,
    port: int,
    *,
    is_master: bool,
    world_size: int | None = None,
    timeout_s: float = 60.0,
) -> dist.TCPStore:
    """A ``TCPStore`` for standalone sync groups (``port=0`` with ``is_master``: a free port).

    The master hosts it; every other member connects to ``host:port`` (a master opened
    on port 0 tells its port as ``store.port``).
    """
    return dist.TCPStore(host, port, world_size, is_master, _td(timeout_s), wait_for_workers=False)


class SyncGroup:
    """A process group made for weight sync, with this rank's place in it.

    ``members`` are plan ranks (the ranks a :class:`~areal_fn.plans.transfer.TransferPlan`
    names), sorted; ``rank`` is this process's plan rank. Make one with
    :meth:`from_world` (ranks of the running ``torch.distributed`` world) or
    :meth:`from_store` (a standalone group over a ``TCPStore``, as a trainer and an
    inference server that share no world do). Either way only the members form the
    group, under a store prefix ``<name>/<generation>`` of its own, so that it can be
    renewed, or re-formed over fewer members, after a failure. ``timeout_s`` bounds
    every wait of a sync (each bucket, and the vote); ``connect_timeout_s`` bounds
    waiting for all members to arrive.
    """

    def __init__(
        self,
        *,
        pg: Transport,
        members: tuple[int, ...],
        rank: int,
        timeout_s: float,
        connect_timeout_s: float,
        generation: int,
        backend: str,
        store: dist.Store,
        name: str,
    ) -> None:
        self._pg: Transport | None = pg
        self.members = members
        self.rank = rank
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.generation = generation
        self.backend = backend
        self.store = store
        self.name = name
        self.syncs = 0  # syncs started on this group (the same count on every member)

    def __repr__(self) -> str:
        return (
            f"SyncGroup({self.name!r} generation {self.generation}, {self.backend}, members "
            f"{list(self.members)}, rank {self.rank}, timeout {self.timeout_s}s"
            f"{', broken' if self.broken else ''})"
        )

    @property
    def broken(self) -> bool:
        """True once a failure spent this group (see :meth:`renew`)."""
        return self._pg is None

    @property
    def pg(self) -> Transport:
        if self._pg is None:
            raise SyncError(
                f"{self!r} is spent by an earlier failure; call group.renew() first",
                version=-1,
            )
        return self._pg

    @classmethod
    def from_world(
        cls,
        members: Sequence[int],
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float | None = None,
        name: str = "weight_sync",
        backend: str | None = None,
    ) -> "SyncGroup":
        """A new group over global ranks ``members`` of the initialised world.

        Only the members call this; plan ranks are global ranks. The group lives on
        the world's store under ``<name>/<members>/<n>``, ``n`` counting the groups
        this process formed with the same name and members (so members form their
        groups in the same order, as with ``new_group``). ``backend`` defaults to
        ``nccl`` when the world uses NCCL, else ``gloo``.
        """
        world = dist.group.WORLD
        if world is None:
            raise PlanError("torch.distributed is not initialised; call init_process_group first")
        ranks = _members(members)
        key = (name, ranks)
        n = _WORLD_GROUPS.get(key, 0)
        _WORLD_GROUPS[key] = n + 1
        if backend is None:
            backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        return cls.from_store(
            dist.PrefixStore("areal_fn.sync", world.get_group_store()),
            members=ranks,
            rank=dist.get_rank(),
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            name=f"{name}/{'-'.join(map(str, ranks))}/{n}",
            backend=backend,
        )

    @classmethod
    def from_store(
        cls,
        store: dist.Store,
        *,
        members: Sequence[int],
        rank: int,
        timeout_s: float = 60.0,
        connect_timeout_s: float | None = None,
        name: str = "weight_sync",
        generation: int = 0,
        backend: str = "gloo",
    ) -> "SyncGroup":
        """A standalone group over ``store`` (no ``init_process_group`` needed).

        Every member calls this with the same ``members``, ``name`` and ``generation``;
        keys live under ``<name>/<generation>/``, so a new generation on the same store
        is a fresh group. Waits up to ``connect_timeout_s`` (default: the larger of
        ``timeout_s`` and 60 s) for all members to arrive.
        """
        ranks = _members(members)
        if rank not in ranks:
            raise PlanError(
                f"rank {rank} is not in the sync group {list(ranks)}; only members form it"
            )
        connect = connect_timeout_s if connect_timeout_s is not None else max(timeout_s, 60.0)
        prefix = f"{name}/{generation}"
        store.set(f"{prefix}/arrived/{rank}", "1")
        try:
            store.wait([f"{prefix}/arrived/{m}" for m in ranks], _td(connect))
        except Exception as e:
            missing = [m for m in ranks if not store.check([f"{prefix}/arrived/{m}"])]
            raise SyncError(
                f"sync group {prefix!r}: members {missing} did not arrive within "
                f"{connect}s ({e}); start them, or renew the group without them",
                version=-1,
            ) from e
        pg = _backend(
            backend,
            dist.PrefixStore(f"{prefix}/pg", store),
            ranks.index(rank),
            len(ranks),
            # the backend's own timeout also bounds its connection set-up (gloo's full
            # mesh), which a loaded machine can take seconds for; every wait of a sync
            # is bounded by ``timeout_s`` explicitly (work.wait, store polls)
            max(timeout_s, connect),
        )
        return cls(
            pg=pg,
            members=ranks,
            rank=rank,
            timeout_s=timeout_s,
            connect_timeout_s=connect,
            generation=generation,
            backend=backend,
            store=store,
            name=name,
        )

    def renew(self, members: Sequence[int] | None = None) -> "SyncGroup":
        """A fresh group, the next generation, over ``members`` (default: the same ones).

        Aborts this group first. Every member of the new group calls it, each from a
        group of the same generation.
        """
        self.abort()
        return SyncGroup.from_store(
            self.store,
            members=self.members if members is None else members,
            rank=self.rank,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            name=self.name,
            generation=self.generation + 1,
            backend=self.backend,
        )

    def abort(self) -> None:
        """Abort and drop the group's connections: peers' pending operations fail at once.

        (gloo closes its sockets only when the process group is destroyed, so the group
        releases its only reference.)
        """
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # already torn down
                pg.abort()
        del pg

    def group_rank(self, plan_rank: int) -> int:
        return self.members.index(plan_rank)

    # the commit decision of sync number ``seq`` lives on the store
    def _key(self, seq: int, what: str) -> str:
        return f"{self.name}/{self.generation}/sync{seq}/{what}"

    def _decide(self, seq: int, proposal: str) -> str:
        """The decision of sync ``seq``: ``proposal`` unless a member decided first."""
        got = self.store.compare_set(self._key(seq, "decision"), "", proposal)
        return got.decode(errors="replace") if isinstance(got, bytes) else str(got)

    def _decided(self, seq: int) -> str | None:
        key = self._key(seq, "decision")
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode(errors="replace")


#: (name, members) -> how many groups this process formed from the world with them.
_WORLD_GROUPS: dict[tuple[str, tuple[int, ...]], int] = {}


def _members(members: Sequence[int]) -> tuple[int, ...]:
    ranks = tuple(sorted(int(m) for m in members))
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0:
        raise PlanError(f"sync group members {list(members)} must be distinct non-negative ranks")
    return ranks


def _backend(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float) -> Transport:
    # (the torch stubs omit Backend's point-to-point methods, hence the casts)
    if backend == "gloo":
        return cast(Transport, dist.ProcessGroupGloo(store, rank, size, _td(timeout_s)))
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise PlanError("backend 'nccl' is not available in this torch build; use 'gloo'")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _td(timeout_s)
        return cast(Transport, dist.ProcessGroupNCCL(store, rank, size, options))
    raise PlanError(f"sync backend {backend!r} is not one of ('gloo', 'nccl')")


# -- messages --------------------------------------------------------------------------
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


def _lookup(tensors: Mapping[str, torch.Tensor], name: str, role: str, t: Transfer) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise PlanError(
            f"transfer {t} needs {role} tensor {name!r}, which this rank does not hold; pass "
            f"every {role} tensor the layout lists for this rank"
        ) from None


def _check_box(tensor: torch.Tensor, box: Box, t: Transfer, role: str) -> None:
    shape = tuple(tensor.shape)
    if len(shape) != box.ndim or any(hi > s for (_, hi), s in zip(box.ranges, shape, strict=True)):
        raise PlanError(
            f"transfer {t}: {role} box {box} does not fit the {role} tensor's shape {shape}; "
            "the tensors do not match the layout the plan was made from"
        )


# -- execution -------------------------------------------------------------------------
@beartype
def send_and_receive(
    plan: BucketPlan,
    *,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: MutableMapping[str, torch.Tensor],
    group: SyncGroup,
    wire_dtype: torch.dtype | None = None,
    on_bucket: Callable[[int], None] | None = None,
) -> SyncReport:
    """Execute ``plan`` on this rank: send its sources, receive and commit its destinations.

    Every member of ``group`` calls this with the same plan (members without transfers
    too: they vote). ``src_tensors`` are this rank's local tensors of the source
    layout, ``dst_tensors`` its live tensors of the destination layout, by layout
    tensor name; live tensors are written in place, only at commit. ``wire_dtype``
    casts what travels (both sides pass the same); by default the sender's dtypes
    travel and must equal the receiver's. ``on_bucket(index)`` runs before each bucket
    this rank takes part in (progress, fault injection).

    Raises :class:`~areal_fn.errors.PlanError` when this rank's tensors do not fit the
    plan and :class:`SyncError` when the sync fails; either way no live tensor
    changed, and the group is spent (:meth:`SyncGroup.renew`).
    """
    start = time.perf_counter()
    version, me = plan.version, group.rank
    if group.broken:
        raise SyncError(
            f"{group!r} is spent by an earlier failure; call group.renew() first",
            version=version,
        )
    seq = group.syncs
    group.syncs += 1
    _forget(group, seq - 2)
    try:
        outside = sorted({r for t in plan.transfers for r in (t.src, t.dst)} - set(group.members))
        if outside:
            raise PlanError(
                f"the plan names ranks {outside} outside the sync group {list(group.members)}; "
                "form the group over every source and destination rank"
            )
        steps, shadows, device = _prepare(plan, me, src_tensors, dst_tensors, wire_dtype)
    except PlanError as e:
        _fail(group, seq, f"rank {me}: {e}")
        raise
    progress = _Progress(group, seq)
    sent = received = copied = overhead = messages = 0
    arrived: list[tuple[_Message, torch.Tensor]] = []
    for b, copies, outgoing, incoming in steps:
        progress.advance(b + 1, version)
        try:
            if on_bucket is not None:
                on_bucket(b)
            with torch.no_grad():
                for t in copies:
                    region = shadows[t.dst_tensor][t.dst_box.slices()]
                    src = src_tensors[t.src_tensor][t.src_box.slices()]
                    region.copy_(src.reshape(region.shape))
                    copied += t.box.numel * region.element_size()
        except Exception as e:
            _fail(group, seq, f"sync v{version} failed on rank {me} before bucket {b}: {e!r}")
            raise
        peers = sorted({m.dst for m in outgoing} | {m.src for m in incoming})
        progress.await_peers(peers, b, version)
        arrived = _exchange(
            group, seq, version, b, outgoing, incoming, src_tensors, shadows, device, arrived
        )
        sent += sum(m.payload for m in outgoing)
        overhead += sum(m.size - m.payload for m in outgoing)
        received += sum(m.payload for m in incoming)
        messages += len(outgoing)
    for m, buf in arrived:
        _scatter(m, buf, shadows)
    del arrived
    progress.advance(len(plan.buckets) + 1, version)
    progress.vote(version)
    with torch.no_grad():
        for name, shadow in shadows.items():
            dst_tensors[name].copy_(shadow)
    return SyncReport(
        version=version,
        rank=me,
        bytes_sent=sent,
        bytes_received=received,
        bytes_copied=copied,
        overhead_bytes=overhead,
        buckets=len(plan.buckets),
        messages=messages,
        seconds=time.perf_counter() - start,
    )


_Step = tuple[int, list[Transfer], list[_Message], list[_Message]]


def _prepare(
    plan: BucketPlan,
    me: int,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: Mapping[str, torch.Tensor],
    wire_dtype: torch.dtype | None,
) -> tuple[list[_Step], dict[str, torch.Tensor], torch.device]:
    """This rank's work per bucket, its shadow buffers and the device of its buffers."""
    steps: list[_Step] = []
    covered: dict[str, int] = {}
    devices: list[torch.device] = []
    for b in plan.buckets:
        copies: list[Transfer] = []
        out: dict[int, list[Transfer]] = {}
        inc: dict[int, list[Transfer]] = {}
        for t in b.transfers:
            if t.src == me:
                s = _lookup(src_tensors, t.src_tensor, "source", t)
                _check_box(s, t.src_box, t, "source")
                devices.append(s.device)
            if t.dst == me:
                d = _lookup(dst_tensors, t.dst_tensor, "destination", t)
                _check_box(d, t.dst_box, t, "destination")
                covered[t.dst_tensor] = covered.get(t.dst_tensor, 0) + t.box.numel
                devices.append(d.device)
            if t.src == me and t.dst == me:
                copies.append(t)
            elif t.src == me:
                out.setdefault(t.dst, []).append(t)
            elif t.dst == me:
                inc.setdefault(t.src, []).append(t)
        outgoing = [
            _message(me, p, ts, [wire_dtype or src_tensors[t.src_tensor].dtype for t in ts])
            for p, ts in out.items()
        ]
        incoming = [
            _message(p, me, ts, [wire_dtype or dst_tensors[t.dst_tensor].dtype for t in ts])
            for p, ts in inc.items()
        ]
        if copies or outgoing or incoming:
            steps.append((b.index, copies, outgoing, incoming))
    shadows: dict[str, torch.Tensor] = {}
    for name, n in covered.items():
        live = dst_tensors[name]
        # a tensor the plan rewrites whole needs no copy of its old value
        shadows[name] = torch.empty_like(live) if n == live.numel() else live.detach().clone()
    device = devices[0] if devices else torch.device("cpu")
    return steps, shadows, device


def _forget(group: SyncGroup, seq: int) -> None:
    """Delete the store keys of sync ``seq`` (every member is past it by now)."""
    if seq < 0:
        return
    keys = [f"at/{group.rank}"]
    if group.rank == group.members[0]:
        keys += ["progress", "votes", "decision"]
    with contextlib.suppress(Exception):  # housekeeping only
        for what in keys:
            group.store.delete_key(group._key(seq, what))


def _order(me: int, m: _Message) -> tuple[int, int, int]:
    peer = m.dst if m.src == me else m.src
    return (min(me, peer), max(me, peer), m.src)


def _fail(group: SyncGroup, seq: int, reason: str) -> str:
    """Publish ``abort`` (unless decided), drop the connections; the first failure's reason."""
    first = reason
    with contextlib.suppress(Exception):  # the store may be gone with its host
        decided = group._decide(seq, f"{ABORT}: {reason}")
        if decided.startswith(ABORT):
            first = decided[len(ABORT) + 2 :]
    group.abort()
    return first


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
                _unpack(m, version, bucket, buf)
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
        for t, dtype, off in zip(m.transfers, m.dtypes, m.offsets, strict=True):
            n = t.box.numel * dtype.itemsize
            seg = buf[off : off + n].view(dtype).view(t.src_box.shape)
            seg.copy_(tensors[t.src_tensor][t.src_box.slices()])
    return buf


def _unpack(m: _Message, version: int, bucket: int, buf: torch.Tensor) -> None:
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
        for t, dtype, off in zip(m.transfers, m.dtypes, m.offsets, strict=True):
            n = t.box.numel * dtype.itemsize
            region = shadows[t.dst_tensor][t.dst_box.slices()]
            region.copy_(buf[off : off + n].view(dtype).view(region.shape))


class _Progress:
    """This rank's progress through one sync, published on the store, and its peers'.

    Each member keeps a counter ``at/<rank>`` (1 + the bucket it has started; the
    number of buckets + 1 once it votes) and adds the same steps to a shared
    ``progress`` counter. A rank posts a bucket's operations only once the peers it
    exchanges with have started that bucket, so a backend timeout measures one
    bucket's exchange, not a peer's earlier work; and waits on the store (polled) time
    out only after ``timeout_s`` without progress.
    """

    def __init__(self, group: SyncGroup, seq: int) -> None:
        self.group = group
        self.seq = seq
        self.at = 0

    def _add(self, what: str, delta: int) -> int:
        return int(self.group.store.add(self.group._key(self.seq, what), delta))

    def advance(self, value: int, version: int) -> None:
        try:
            self._add(f"at/{self.group.rank}", value - self.at)
            self._add("progress", value - self.at)
        except Exception as e:
            self._store_failed(e, version)
        self.at = value

    def _store_failed(self, e: Exception, version: int) -> None:
        reason = f"rank {self.group.rank} lost the store: {e}"
        _fail(self.group, self.seq, reason)
        raise SyncError(
            f"sync v{version} failed: {reason}; live tensors are unchanged here",
            version=version,
        ) from e

    def _aborted(self, version: int, bucket: int | None) -> None:
        decided = self.group._decided(self.seq)
        if decided is not None and decided.startswith(ABORT):
            self.group.abort()
            raise SyncError(
                f"sync v{version} aborted on rank {self.group.rank}"
                f"{'' if bucket is None else f' before bucket {bucket}'}: "
                f"{decided[len(ABORT) + 2 :]}. Live tensors are unchanged; renew the group",
                version=version,
                bucket=bucket,
            )

    def await_peers(self, peers: Sequence[int], bucket: int, version: int) -> None:
        """Wait until every peer has started ``bucket`` (or an abort, or no progress)."""
        if not peers:
            return
        pause, last, deadline = _POLL_S[0], None, time.monotonic() + self.group.timeout_s
        try:
            while True:
                at = {p: self._add(f"at/{p}", 0) for p in peers}
                behind = {p: v for p, v in at.items() if v < bucket + 1}
                if not behind:
                    return
                self._aborted(version, bucket)
                if at != last:
                    last, deadline = at, time.monotonic() + self.group.timeout_s
                elif time.monotonic() > deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, _POLL_S[1])
        except SyncError:
            raise
        except Exception as e:
            self._store_failed(e, version)
        peer, value = min(behind.items(), key=lambda kv: (kv[1], kv[0]))
        where = "has not started the sync" if value == 0 else f"is stuck in bucket {value - 1}"
        reason = (
            f"sync v{version}: rank {self.group.rank} waited {self.group.timeout_s}s before "
            f"bucket {bucket} for rank {peer}, which {where}"
        )
        first = _fail(self.group, self.seq, reason)
        raise SyncError(
            reason + ("" if first == reason else f"; the first failure: {first}"),
            version=version,
            bucket=bucket,
            peer=peer,
        )

    def vote(self, version: int) -> None:
        """Wait until every member finished its buckets; commit or abort, all alike."""
        group, seq = self.group, self.seq
        me, size = group.rank, len(group.members)
        pause, deadline = _POLL_S[0], time.monotonic() + group.timeout_s
        try:
            arrived, last = self._add("votes", 1), self._add("progress", 0)
            while True:
                if arrived >= size:
                    decision = group._decide(seq, COMMIT)
                    break
                decided = group._decided(seq)
                if decided is not None:
                    decision = decided
                    break
                total = self._add("progress", 0)
                if total != last:
                    last, deadline = total, time.monotonic() + group.timeout_s
                elif time.monotonic() > deadline:
                    decision = group._decide(
                        seq,
                        f"{ABORT}: rank {me} waited {group.timeout_s}s at the commit vote for "
                        f"{size - arrived} of {size} members, none of which made progress",
                    )
                    break
                time.sleep(pause)
                pause = min(pause * 2, _POLL_S[1])
                arrived = self._add("votes", 0)
        except Exception as e:
            _fail(group, seq, f"rank {me} lost the store at the commit vote: {e}")
            raise SyncError(
                f"sync v{version} aborted on rank {me}: the store failed at the commit vote "
                f"({e}); live tensors are unchanged here, other members may have committed",
                version=version,
            ) from e
        if decision == COMMIT:
            return
        group.abort()
        raise SyncError(
            f"sync v{version} aborted on rank {me} at the commit vote: "
            f"{decision[len(ABORT) + 2 :]}. Live tensors are unchanged; renew the group",
            version=version,
        )
