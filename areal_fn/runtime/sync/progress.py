"""Sync progress on the store: who has started which bucket, and the commit vote.

**Progress and timeouts.** Every member publishes on the group's store which bucket
it has started. A rank posts a bucket's operations only once the peers it exchanges
with in that bucket have started it, so ``timeout_s`` bounds one bucket's exchange
(not a peer's earlier buckets with other ranks); waits on the store time out only
after ``timeout_s`` without any progress.

**The vote.** After its last bucket a rank votes on the store and waits until every
member has voted; then one ``compare_set`` on the store decides, for everyone,
``commit`` or ``abort`` (:meth:`_Progress.vote`). Each vote carries its member's MAC
and the decision the group's (:func:`~areal_fn.runtime.sync.auth.sign`): a rank
proposes ``commit`` only once every member's vote verifies, and a decision without the
group's MAC reads as ``abort``, so a process without the secret can neither commit nor
abort a version by writing to the store (it can still delay a sync: the progress
counters are not authenticated).
"""

import time
from collections.abc import Sequence

from areal_fn.runtime.sync.auth import sign, verified
from areal_fn.runtime.sync.group import ABORT, COMMIT, SyncError, SyncGroup, _fail

#: Store polls: the first pause, the longest pause during the first ``_POLL_S[2]``
#: seconds of a wait, the longest after. A peer or a vote is usually milliseconds away
#: (every pause past its arrival delays the sync); long waits poll the store gently.
_POLL_S = (0.0001, 0.001, 0.1, 0.02)


def _next_pause(pause: float, since: float) -> float:
    """The pause after ``pause`` in a wait that began at ``since`` (``time.monotonic``)."""
    _, short, window, longest = _POLL_S
    return min(pause * 2, short if time.monotonic() - since < window else longest)


class _Progress:
    """This rank's progress through one sync, published on the store, and its peers'.

    Each member keeps a counter ``at/<rank>`` (1 + the bucket it has started; 2 + its
    last bucket once it votes) and adds the same steps to a shared
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
        since = time.monotonic()
        pause, last, deadline = _POLL_S[0], None, since + self.group.timeout_s
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
                pause = _next_pause(pause, since)
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

    def _unverified_votes(self) -> list[int]:
        """The members whose vote is missing or lacks their MAC (forged, or not yet cast)."""
        group = self.group
        keys = [group._key(self.seq, f"vote/{m}") for m in group.members]
        if not group.store.check(keys):
            return [
                m for m, k in zip(group.members, keys, strict=True) if not group.store.check([k])
            ]
        votes = group.store.multi_get(keys)
        return [
            m
            for m, v in zip(group.members, votes, strict=True)
            if verified(group._session, "vote", self.seq, v) != f"vote {m}"
        ]

    def vote(self, version: int) -> None:
        """Wait until every member finished its buckets; commit or abort, all alike."""
        group, seq = self.group, self.seq
        me, size = group.rank, len(group.members)
        since = time.monotonic()
        pause, deadline = _POLL_S[0], since + group.timeout_s
        unverified: list[int] = []
        try:
            mine = sign(group._session, "vote", seq, f"vote {me}")
            group.store.set(group._key(seq, f"vote/{me}"), mine)
            arrived, last = self._add("votes", 1), self._add("progress", 0)
            while True:
                # the counter is only a cue; the votes themselves must verify
                if arrived >= size and not (unverified := self._unverified_votes()):
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
                    decision = group._decide(seq, self._timeout_reason(arrived, unverified))
                    break
                time.sleep(pause)
                pause = _next_pause(pause, since)
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

    def _timeout_reason(self, arrived: int, unverified: list[int]) -> str:
        group, size = self.group, len(self.group.members)
        head = f"{ABORT}: rank {group.rank} waited {group.timeout_s}s at the commit vote"
        if arrived >= size and unverified:
            return (
                f"{head}: the count says all {size} members voted, but the votes of ranks "
                f"{unverified} are missing or do not carry their MAC (a process without the "
                "group's secret wrote to the count or the votes)"
            )
        return f"{head} for {size - arrived} of {size} members, none of which made progress"
