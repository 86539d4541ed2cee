"""Sync groups: the process group a weight sync runs over, and its store.

A :class:`SyncGroup` is formed by its members only (:meth:`SyncGroup.from_world` over
ranks of a running world, :meth:`SyncGroup.from_store` over a standalone
``TCPStore``, :func:`open_store`), under a store prefix ``<name>/<generation>`` of
its own; the store also carries each sync's progress and its one commit decision. A
failure publishes ``abort`` and spends the group (``_fail``); :meth:`SyncGroup.renew`
forms the next generation. Members prove at rendezvous that they hold the group's
secret, and the decision carries a MAC (:mod:`areal_fn.runtime.sync.auth`).
"""

import contextlib
import datetime
from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

from areal_fn.errors import PlanError
from areal_fn.runtime.sync.auth import (
    SECRET_ENV,
    arrival,
    check_arrivals,
    group_secret,
    session_key,
    sign,
    verified,
)
from areal_fn.typecheck import beartype

COMMIT, ABORT = "commit", "abort"


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

    Every member holds the group's secret (``secret=``, else ``$AREAL_FN_SYNC_SECRET``;
    a group over a store other processes can reach is refused without one) and proves
    it at rendezvous; a member whose proof fails is named in a :class:`SyncError`. The
    messages, votes and the decision of every sync carry MACs under a key of this group
    instance (:mod:`areal_fn.runtime.sync.auth`).
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
        secret: bytes,
        session: bytes,
    ) -> None:
        self._pg: Transport | None = pg
        self._secret = secret  # to renew the group
        self._session = session  # the MAC key of this instance (secret, prefix, nonces)
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
        secret: bytes | str | None = None,
    ) -> "SyncGroup":
        """A new group over global ranks ``members`` of the initialised world.

        Only the members call this; plan ranks are global ranks. The group lives on
        the world's store under ``<name>/<members>/<n>``, ``n`` counting the groups
        this process formed with the same name and members (so members form their
        groups in the same order, as with ``new_group``). ``backend`` defaults to
        ``nccl`` when the world uses NCCL, else ``gloo``. ``secret`` as in
        :meth:`from_store` (the world's store, a ``TCPStore`` under ``torchrun``, needs
        one; ``run_torchrun`` sets ``$AREAL_FN_SYNC_SECRET`` for the ranks it starts).
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
            secret=secret,
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
        secret: bytes | str | None = None,
    ) -> "SyncGroup":
        """A standalone group over ``store`` (no ``init_process_group`` needed).

        Every member calls this with the same ``members``, ``name``, ``generation`` and
        secret; keys live under ``<name>/<generation>/``, so a new generation on the
        same store is a fresh group. Waits up to ``connect_timeout_s`` (default: the
        larger of ``timeout_s`` and 60 s) for all members to arrive, then checks each
        member's proof of the secret before any connection is made.

        ``secret`` (at least 16 bytes; a ``str`` is UTF-8 encoded) defaults to
        ``$AREAL_FN_SYNC_SECRET``. Without either, a store only this process can reach
        (a ``HashStore``) uses this process's own random secret, and any other store is
        refused with :class:`~areal_fn.errors.PlanError` before anything is posted.
        """
        ranks = _members(members)
        if rank not in ranks:
            raise PlanError(
                f"rank {rank} is not in the sync group {list(ranks)}; only members form it"
            )
        connect = connect_timeout_s if connect_timeout_s is not None else max(timeout_s, 60.0)
        prefix = f"{name}/{generation}"
        key = group_secret(secret, store, prefix)
        session = _rendezvous(store, prefix, ranks, rank, key, connect)
        try:
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
        except RuntimeError as e:
            raise SyncError(
                f"sync group {prefix!r}: rank {rank} could not connect to the other members "
                f"({e}); a member left while the group formed: renew the group",
                version=-1,
            ) from e
        # a member that returns and aborts at once must not cut a peer's connection set-up
        # short (gloo's full mesh finishes per pair): return when every member is connected
        _wait_members(store, f"{prefix}/connected", ranks, rank, connect)
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
            secret=key,
            session=session,
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
            secret=self._secret,
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

    def post_signed(self, what: str, text: str) -> None:
        """Post ``text`` under ``what`` on the group's store, with the group's MAC."""
        key = f"{self.name}/{self.generation}/note/{what}"
        self.store.set(key, sign(self._session, f"note/{what}", 0, text))

    def read_signed(self, what: str, *, timeout_s: float | None = None) -> str:
        """The text a member posted with :meth:`post_signed`; waits up to ``timeout_s``
        (default the group's ``timeout_s``). Raises :class:`SyncError` when none arrives in
        time or its MAC fails (a process without the group's secret wrote it)."""
        key = f"{self.name}/{self.generation}/note/{what}"
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait([key], _td(wait))
        except Exception as e:
            raise SyncError(
                f"sync group {self.name!r}: no member posted {what!r} within {wait}s ({e})",
                version=-1,
            ) from e
        text = verified(self._session, f"note/{what}", 0, self.store.get(key))
        if text is None:
            raise SyncError(
                f"sync group {self.name!r}: the {what!r} posted on the store does not carry "
                "the group's MAC (a process without the group's secret wrote it); refused",
                version=-1,
            )
        return text

    def group_rank(self, plan_rank: int) -> int:
        return self.members.index(plan_rank)

    # the commit decision of sync number ``seq`` lives on the store
    def _key(self, seq: int, what: str) -> str:
        return f"{self.name}/{self.generation}/sync{seq}/{what}"

    def _decide(self, seq: int, proposal: str) -> str:
        """The decision of sync ``seq``: ``proposal`` unless a member decided first."""
        signed = sign(self._session, "decision", seq, proposal)
        got = self.store.compare_set(self._key(seq, "decision"), "", signed)
        return self._read_decision(seq, got)

    def _decided(self, seq: int) -> str | None:
        key = self._key(seq, "decision")
        if not self.store.check([key]):
            return None
        return self._read_decision(seq, self.store.get(key))

    def _read_decision(self, seq: int, value: bytes | str) -> str:
        """A decision's text; one without this group's MAC reads as ``abort`` (forged)."""
        text = verified(self._session, "decision", seq, value)
        if text is not None:
            return text
        return (
            f"{ABORT}: the decision posted on the store for sync {seq} of {self.name!r} "
            f"generation {self.generation} does not carry this group's MAC (a process without "
            "the group's secret wrote it), so no member commits on it"
        )


#: (name, members) -> how many groups this process formed from the world with them.
_WORLD_GROUPS: dict[tuple[str, tuple[int, ...]], int] = {}


def _members(members: Sequence[int]) -> tuple[int, ...]:
    ranks = tuple(sorted(int(m) for m in members))
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0:
        raise PlanError(f"sync group members {list(members)} must be distinct non-negative ranks")
    return ranks


def _wait_members(
    store: dist.Store,
    at: str,
    ranks: tuple[int, ...],
    rank: int,
    connect_s: float,
    value: str = "1",
) -> list[str]:
    """Post ``value`` under ``at/<rank>``, wait for every member's key; the keys."""
    prefix = at.rsplit("/", 1)[0]
    keys = [f"{at}/{m}" for m in ranks]
    store.set(keys[ranks.index(rank)], value)
    try:
        store.wait(keys, _td(connect_s))
    except Exception as e:
        missing = [m for m, k in zip(ranks, keys, strict=True) if not store.check([k])]
        raise SyncError(
            f"sync group {prefix!r}: members {missing} did not arrive within "
            f"{connect_s}s ({e}); start them, or renew the group without them",
            version=-1,
        ) from e
    return keys


def _rendezvous(
    store: dist.Store,
    prefix: str,
    ranks: tuple[int, ...],
    rank: int,
    secret: bytes,
    connect_s: float,
) -> bytes:
    """Post this member's proof, wait for all members, check theirs; the session key."""
    _, proof = arrival(secret, prefix, rank)
    keys = _wait_members(store, f"{prefix}/arrived", ranks, rank, connect_s, proof)
    posted = dict(zip(ranks, store.multi_get(keys), strict=True))
    nonces, bad = check_arrivals(secret, prefix, posted)
    if bad:
        which, who = (
            (f"rank {bad[0]}", f"the process that joined as rank {bad[0]} holds")
            if len(bad) == 1
            else (f"ranks {bad}", f"the processes that joined as ranks {bad} hold")
        )
        raise SyncError(
            f"sync group {prefix!r}: the proof of the group's secret posted for {which} does "
            f"not verify on rank {rank}: {who} another secret than this one, or none. "
            f"Refused before any connection or bucket; give "
            f"every member the same secret (secret= or {SECRET_ENV}), keep other "
            "processes off the store, and form the group again under a new generation",
            version=-1,
            peer=bad[0],
        )
    return session_key(secret, prefix, [nonces[m] for m in ranks])


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


def _fail(group: SyncGroup, seq: int, reason: str) -> str:
    """Publish ``abort`` (unless decided), drop the connections; the first failure's reason."""
    first = reason
    with contextlib.suppress(Exception):  # the store may be gone with its host
        decided = group._decide(seq, f"{ABORT}: {reason}")
        if decided.startswith(ABORT):
            first = decided[len(ABORT) + 2 :]
    group.abort()
    return first
