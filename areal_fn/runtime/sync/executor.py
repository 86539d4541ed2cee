"""Weight sync: execute a :class:`~areal_fn.plans.transfer.BucketPlan` over a process group.

The plan is pure data computed identically on every rank
(:func:`~areal_fn.plans.transfer.plan_transfers` then :func:`~areal_fn.plans.transfer.bucket`),
or each rank's own rows of it
(:func:`~areal_fn.plans.transfer.plan_rank_transfers`, bucketed the same way: a row's
bucket depends on that row alone); this module only moves bytes::

    plan = bucket(plan_transfers(train, infer, src_ranks=[0, 1], dst_ranks=[2, 3]),
                  64 << 20, version=step)
    group = SyncGroup.from_world([0, 1, 2, 3], timeout_s=30)      # or SyncGroup.from_store
    report = send_and_receive(plan, src_tensors=mine, dst_tensors=live, group=group)

**Wire format.** Per bucket, everything a rank sends one peer is one message, a
header and the boxes (:mod:`areal_fn.runtime.sync.messages`); large boxes travel
straight from the sources and into the shadows, the rest through message buffers
(kept by the group between syncs with ``keep_staging=True``). The receiver derives the same order and offsets from the same
plan, and the header turns a disagreement into an error instead of wrong weights. Transfers a rank makes to
itself are local copies (:func:`~areal_fn.plans.transfer.apply.copy_box`, as in the
plan's reference semantics :func:`~areal_fn.plans.transfer.apply.apply_transfers`).

**Progress and timeouts.** Every member publishes on the group's store which bucket
it has started; a rank posts a bucket's operations only once its peers in that
bucket have started it, so ``timeout_s`` bounds one bucket's exchange
(:mod:`areal_fn.runtime.sync.progress`).

**Atomicity.** Received boxes are staged in shadow buffers (one copy of the tensors
this rank receives; handed back when the sync ends, or kept by the group for the next
sync with ``keep_staging=True``: :mod:`areal_fn.runtime.sync.staging`). After its last bucket a
rank votes on the store and waits until every member has voted; then one
``compare_set`` on the store decides, for everyone, ``commit`` or ``abort``. Only
after ``commit`` does a rank copy its shadows into its live tensors. A rank that
fails (a timeout, a peer's death, a header mismatch, a bad input) publishes ``abort``
with its reason and drops its connections, which fails its peers' pending operations
at once; every member then raises :class:`SyncError` (naming, where it knows them, the
bucket, the peer and the tensors, and the first failure's reason) and no live tensor
changes. The one way to end split: a rank that loses the store itself after the
others decided ``commit``; its error says so.

**Authentication.** Members prove at rendezvous that they hold the group's secret;
every message, vote and decision carries a MAC under the group's session key
(:mod:`areal_fn.runtime.sync.auth`). A message that fails its MAC is refused before
unpacking, like any other header mismatch: the receiver publishes ``abort``, and no
live tensor changes.

**Recovery.** A failed group is spent. :meth:`SyncGroup.renew` forms a fresh one under
the next generation of its store prefix, optionally over fewer members, after which
the next sync can succeed.
"""

import contextlib
import time
from collections.abc import Callable, Mapping, MutableMapping

import attrs
import torch

from areal_fn.errors import PlanError
from areal_fn.plans.transfer import BucketPlan, Transfer
from areal_fn.plans.transfer.apply import copy_box, with_views
from areal_fn.runtime.sync.delta import (
    DeltaStaged,
    DeltaState,
    check_delta_tensors,
    commit_delta,
    run_delta_steps,
)
from areal_fn.runtime.sync.group import SyncError, SyncGroup, Transport, _fail, open_store
from areal_fn.runtime.sync.messages import _Arrival, _exchange, _Message, _message, _Sealed
from areal_fn.runtime.sync.progress import _Progress
from areal_fn.runtime.sync.staging import _buffers, release_staging
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

__all__ = [
    "DeltaState",
    "SyncError",
    "SyncGroup",
    "SyncReport",
    "Transport",
    "open_store",
    "send_and_receive",
]


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
    #: payload bytes this rank's messages hold dense (sent and received): what a full
    #: sync moves; ``bytes_sent + bytes_received`` is what travelled
    bytes_full: int = 0
    #: messages this rank sent or received as deltas (``delta=``), not dense
    delta_messages: int = 0
    #: live tensors committed by exchanging storages with their shadows
    #: (``commit="swap"``); the rest of what this rank received was copied in
    tensors_swapped: int = 0


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
    keep_staging: bool = False,
    delta: DeltaState | None = None,
    commit: str = "copy",
) -> SyncReport:
    """Execute ``plan`` on this rank: send its sources, receive and commit its destinations.

    Every member of ``group`` calls this with the same plan (members without transfers
    too: they vote). ``src_tensors`` are this rank's local tensors of the source
    layout, ``dst_tensors`` its live tensors of the destination layout, by layout
    tensor name; live tensors are written in place, only at commit. ``wire_dtype``
    casts what travels (both sides pass the same); by default the sender's dtypes
    travel and must equal the receiver's. ``on_bucket(index)`` runs before each bucket
    this rank takes part in (progress, fault injection). ``keep_staging``: the group
    keeps this sync's staging memory for the next one (message buffers and one shadow
    per received tensor: a copy of what this rank receives, held while the group
    lives; reused memory is faster to fill); by default it is handed back when the sync
    ends: large CPU buffers keep their mappings with their pages given to the kernel
    (``MADV_FREE``: taken when memory is needed, else reused without page faults), the
    rest is freed (:mod:`areal_fn.runtime.sync.staging`). ``delta``: this rank's
    :class:`~areal_fn.runtime.sync.delta.DeltaState` (every member passes one, or none
    does): each message carries only the elements changed since the version its
    receiver holds, else it goes dense (:mod:`areal_fn.runtime.sync.delta`).
    ``commit``: how a dense sync's shadows become live once the group decided
    ``commit``: ``"copy"`` (the default) copies each shadow into its live tensor;
    ``"swap"`` exchanges their storages instead, for every live tensor that is no view
    and spans its whole storage (:func:`~areal_fn.runtime.sync.staging.owns_storage`;
    the others are copied): no copy, and the live tensor objects stay the same, but
    their memory changes from sync to sync, so it is only for callers whose live
    tensors have no aliases (views taken earlier, tied weights held as other tensors,
    addresses captured by a CUDA graph keep the old memory). With ``keep_staging=True``
    the old memory is the next sync's shadow (2x the received bytes held, as with
    ``"copy"``). A delta sync writes its changes in place: it takes ``"copy"`` only.

    Raises :class:`~areal_fn.errors.PlanError` when this rank's tensors do not fit the
    plan and :class:`SyncError` when the sync fails; either way no live tensor
    changed, and the group is spent (:meth:`SyncGroup.renew`).
    """
    try:
        return _send_and_receive(
            plan, src_tensors, dst_tensors, group, wire_dtype, on_bucket, delta, commit
        )
    finally:
        if not keep_staging:
            release_staging(group)


def _send_and_receive(
    plan: BucketPlan,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: MutableMapping[str, torch.Tensor],
    group: SyncGroup,
    wire_dtype: torch.dtype | None,
    on_bucket: Callable[[int], None] | None,
    delta: DeltaState | None = None,
    commit: str = "copy",
) -> SyncReport:
    start = time.perf_counter()
    version, me = plan.version, group.rank
    seq = _begin(group, version)
    try:
        _check_commit(commit, delta)
        _check_in_group(plan, group)
        # views share storage with the caller's tensors: committing writes them in place
        src_tensors = with_views(plan.src_views, src_tensors, "source")
        dst_tensors = with_views(plan.dst_views, dst_tensors, "destination")
        steps, covered, device = _prepare(plan, me, src_tensors, dst_tensors, wire_dtype)
        if delta is None:
            shadows = _shadows(group, covered, dst_tensors)
        else:
            check_delta_tensors(steps, dst_tensors)
    except PlanError as e:
        _fail(group, seq, f"rank {me}: {e}")
        raise
    progress = _Progress(group, seq)
    if delta is not None:
        staged = run_delta_steps(
            group, seq, version, steps, progress, src_tensors, device, on_bucket, delta
        )
        progress.advance(plan.buckets[-1].index + 2 if plan.buckets else 1, version)
        progress.vote(version)
        commit_delta(staged, version, src_tensors, dst_tensors, delta)
        return _delta_report(staged, version, me, len(plan.buckets), start)
    counts = _run_steps(
        group, seq, version, steps, progress, src_tensors, shadows, device, on_bucket
    )
    # past every bucket index of this rank's plan (a rank's own plan skips buckets)
    progress.advance(plan.buckets[-1].index + 2 if plan.buckets else 1, version)
    progress.vote(version)
    swapped = _commit(group, shadows, dst_tensors, swap=commit == "swap")
    sent, received, copied, overhead, messages = counts
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
        bytes_full=sent + received,
        tensors_swapped=swapped,
    )


COMMITS = ("copy", "swap")


def _check_commit(commit: str, delta: DeltaState | None) -> None:
    if commit not in COMMITS:
        raise PlanError(
            f"commit={commit!r} is not a way to commit a sync; use one of {list(COMMITS)}"
        )
    if commit == "swap" and delta is not None:
        raise PlanError(
            "commit='swap' with delta=: a delta sync writes its changes into the live "
            "tensors in place and has no shadows to swap; use commit='copy' with delta"
        )


def _commit(
    group: SyncGroup,
    shadows: Mapping[str, torch.Tensor],
    dst_tensors: Mapping[str, torch.Tensor],
    *,
    swap: bool,
) -> int:
    """Make the shadows live (after the group decided ``commit``): each swapped in where
    ``swap`` and its live tensor allows, else copied; the number swapped."""
    staging, swapped = _buffers(group), 0
    with torch.no_grad():
        for name, shadow in shadows.items():
            if swap and staging.swap_in(name, dst_tensors[name]):
                swapped += 1
            else:
                dst_tensors[name].copy_(shadow)
    return swapped


def _delta_report(
    staged: DeltaStaged, version: int, me: int, buckets: int, start: float
) -> SyncReport:
    copied = sum(t.nbytes for t in staged.copies)
    return SyncReport(
        version=version,
        rank=me,
        bytes_sent=staged.sent_bytes,
        bytes_received=staged.received_bytes,
        bytes_copied=copied,
        overhead_bytes=staged.overhead,
        buckets=buckets,
        messages=len(staged.sent),
        seconds=time.perf_counter() - start,
        bytes_full=staged.full_bytes,
        delta_messages=staged.deltas,
    )


def _run_steps(
    group: SyncGroup,
    seq: int,
    version: int,
    steps: "list[_Step]",
    progress: _Progress,
    src_tensors: Mapping[str, torch.Tensor],
    shadows: Mapping[str, torch.Tensor],
    device: torch.device,
    on_bucket: Callable[[int], None] | None,
) -> tuple[int, int, int, int, int]:
    """Every bucket of this rank, in order; (bytes sent, received, copied, overhead,
    messages). Bucket k+1's messages are packed and sealed while bucket k is in flight,
    into the other of two buffer slots."""
    sent = received = copied = overhead = messages = 0
    arrived: list[_Arrival] = []
    packed: dict[int, _Sealed] = {}  # this bucket's messages, sealed in the one before
    for step, (b, copies, outgoing, incoming) in enumerate(steps):
        progress.advance(b + 1, version)
        copied += _copy_local(group, seq, version, b, copies, src_tensors, shadows, on_bucket)
        peers = sorted({m.dst for m in outgoing} | {m.src for m in incoming})
        progress.await_peers(peers, b, version)
        nxt = steps[step + 1] if step + 1 < len(steps) else None
        arrived, packed = _exchange(
            group,
            seq,
            version,
            b,
            outgoing,
            incoming,
            src_tensors,
            shadows,
            device,
            arrived,
            step % 2,
            packed,
            None if nxt is None else (nxt[0], nxt[2], (step + 1) % 2),
        )
        sent += sum(m.payload for m in outgoing)
        overhead += sum(m.size - m.payload for m in outgoing)
        received += sum(m.payload for m in incoming)
        messages += len(outgoing)
    last = steps[-1][0] if steps else 0  # check and unpack the last bucket's arrivals
    _exchange(group, seq, version, last, [], [], src_tensors, shadows, device, arrived, 0)
    return sent, received, copied, overhead, messages


def _begin(group: SyncGroup, version: int) -> int:
    """The number of this sync on ``group`` (none on a spent group); forgets the one before last."""
    if group.broken:
        raise SyncError(
            f"{group!r} is spent by an earlier failure; call group.renew() first",
            version=version,
        )
    seq = group.syncs
    group.syncs += 1
    _forget(group, seq - 2)
    return seq


def _check_in_group(plan: BucketPlan, group: SyncGroup) -> None:
    outside = sorted({r for t in plan.transfers for r in (t.src, t.dst)} - set(group.members))
    if outside:
        raise PlanError(
            f"the plan names ranks {outside} outside the sync group {list(group.members)}; "
            "form the group over every source and destination rank"
        )


def _copy_local(
    group: SyncGroup,
    seq: int,
    version: int,
    bucket: int,
    copies: list[Transfer],
    src_tensors: Mapping[str, torch.Tensor],
    shadows: Mapping[str, torch.Tensor],
    on_bucket: Callable[[int], None] | None,
) -> int:
    """Run ``on_bucket``, then copy the bucket's local transfers into the shadows; the bytes."""
    copied = 0
    try:
        if on_bucket is not None:
            on_bucket(bucket)
        with torch.no_grad():
            for t in copies:
                shadow = shadows[t.dst_tensor]
                copy_box(src_tensors[t.src_tensor], shadow, t)
                copied += t.box.numel * shadow.element_size()
    except Exception as e:
        _fail(
            group, seq, f"sync v{version} failed on rank {group.rank} before bucket {bucket}: {e!r}"
        )
        raise
    return copied


_Step = tuple[int, list[Transfer], list[_Message], list[_Message]]


def _prepare(
    plan: BucketPlan,
    me: int,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: Mapping[str, torch.Tensor],
    wire_dtype: torch.dtype | None,
) -> tuple[list[_Step], dict[str, int], torch.device]:
    """This rank's work per bucket, the elements it receives per destination tensor and
    the device of its buffers."""
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
    device = devices[0] if devices else torch.device("cpu")
    return steps, covered, device


def _shadows(
    group: SyncGroup, covered: Mapping[str, int], dst_tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A shadow per destination tensor the plan writes (elements ``covered``), from the
    group's staging memory: one the plan rewrites whole needs no copy of its old value."""
    staging = _buffers(group)
    with torch.no_grad():
        return {
            name: staging.shadow(name, dst_tensors[name], whole=n == dst_tensors[name].numel())
            for name, n in covered.items()
        }


def _forget(group: SyncGroup, seq: int) -> None:
    """Delete the store keys of sync ``seq`` (every member is past it by now)."""
    if seq < 0:
        return
    keys = [f"at/{group.rank}", f"vote/{group.rank}", f"holds/{group.rank}"]
    if group.rank == group.members[0]:
        keys += ["progress", "votes", "decision"]
    with contextlib.suppress(Exception):  # housekeeping only
        for what in keys:
            group.store.delete_key(group._key(seq, what))


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
