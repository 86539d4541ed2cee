"""Delta syncs (:mod:`areal_fn.runtime.sync.delta`), in process: members are threads.

Each test runs several versions through one group; every delta sync must leave the
live tensors bitwise equal to :func:`~areal_fn.plans.transfer.apply.apply_transfers`
of the new version (the plan's reference semantics, i.e. a full sync).
"""

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from areal_fn.errors import PlanError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.plans.delta import delta_base_bytes
from areal_fn.runtime.sync.executor import (
    DeltaState,
    SyncError,
    SyncGroup,
    SyncReport,
    send_and_receive,
)
from areal_fn.strategy.allocation import ParallelDims
from tests.distributed.test_weight_sync import (
    SPEC,
    Case,
    _Tamper,
    canonical,
    run_ranks,
    same,
    split_case,
)

Live = dict[str, torch.Tensor]


def versions(n: int, *, changed: float = 0.01, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` successive versions: each changes about ``changed`` of the elements."""
    gen = torch.Generator().manual_seed(seed)
    out = [canonical(seed)]
    for _ in range(n - 1):
        nxt = {}
        for name, t in out[-1].items():
            hit = torch.rand(t.shape, generator=gen) < changed
            nxt[name] = torch.where(hit, t + 0.5, t)
        out.append(nxt)
    return out


def run_versions(
    case: Case,
    values: list[dict[str, torch.Tensor]],
    *,
    start: dict[str, torch.Tensor],
    states: list[DeltaState] | None = None,
    before: Callable[[int, int, SyncGroup, DeltaState, Live], None] | None = None,
    renew_after_error: bool = False,
) -> tuple[list[list[Any]], list[dict[str, torch.Tensor]], list[DeltaState]]:
    """Sync version ``v + 1`` of ``values[v]`` for every ``v`` over one group per rank:
    (each rank's reports or errors, live tensors, delta states)."""
    lives = [case.live(r, start) for r in range(case.world)]
    states = states or [DeltaState() for _ in range(case.world)]

    def body(rank: int, store: dist.Store) -> list[Any]:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        got: list[Any] = []
        for v, value in enumerate(values):
            if before is not None:
                before(rank, v, group, states[rank], lives[rank])
            plan = Case(case.src, case.dst, case.src_ranks, case.dst_ranks, version=v + 1).buckets
            try:
                got.append(
                    send_and_receive(
                        plan,
                        src_tensors=case.sources(rank, value),
                        dst_tensors=lives[rank],
                        group=group,
                        delta=states[rank],
                    )
                )
            except (SyncError, PlanError) as e:
                got.append(e)
                if renew_after_error:
                    group = group.renew()
        return got

    return run_ranks(case.world, body, timeout_s=60), lives, states


def test_delta_syncs_equal_full_syncs_bitwise_and_send_less() -> None:
    case = split_case()
    values = versions(4)
    results, lives, states = run_versions(case, values, start=canonical(99))
    assert all(isinstance(r, SyncReport) for rs in results for r in rs), results
    for rank in case.dst_ranks:  # the last version, as a full sync leaves it
        assert same(lives[rank], case.reference(canonical(99), values[-1])[rank])
        assert states[rank].holds == len(values)
    first = [results[r][0] for r in case.dst_ranks]
    assert all(r.delta_messages == 0 and r.bytes_received == r.bytes_full for r in first)
    for v in range(1, len(values)):
        for rank in case.dst_ranks:
            rep = results[rank][v]
            assert rep.delta_messages > 0
            assert rep.bytes_received < 0.3 * rep.bytes_full, rep
        assert sum(results[r][v].bytes_full for r in case.dst_ranks) == case.lower_bound
    for rank in case.src_ranks:  # the source keeps exactly what it sends
        assert states[rank].kept_bytes == delta_base_bytes(case.buckets, rank) > 0
        assert states[rank].base_version == len(values)


@pytest.mark.parametrize(("max_bytes", "changed"), [(900, 0.2), (1500, 0.002), (4096, 1.0)])
def test_every_version_is_bitwise_the_full_sync(max_bytes: int, changed: float) -> None:
    case = split_case(max_bytes=max_bytes)
    values = versions(4, changed=changed, seed=3)
    checked: list[int] = []

    def check(rank: int, v: int, group: SyncGroup, state: DeltaState, live: Live) -> None:
        if v > 0 and rank in case.dst_ranks:  # what version v committed on this rank
            assert same(live, case.reference(canonical(5), values[v - 1])[rank])
            checked.append(v)

    results, lives, _ = run_versions(case, values, start=canonical(5), before=check)
    assert all(isinstance(r, SyncReport) for rs in results for r in rs), results
    assert sorted(checked) == [1, 1, 2, 2, 3, 3]
    for rank in case.dst_ranks:
        assert same(lives[rank], case.reference(canonical(5), values[-1])[rank])


def test_a_version_mismatch_falls_back_to_a_full_sync() -> None:
    case = split_case()
    values = versions(3, seed=7)

    def lose(rank: int, v: int, group: SyncGroup, state: DeltaState, live: Live) -> None:
        if v == 1 and rank == 2:
            state.holds = 17  # claims a version no source kept
        if v == 2 and rank == 3:
            state.forget()  # lost its copy

    results, lives, states = run_versions(case, values, start=canonical(8), before=lose)
    assert all(isinstance(r, SyncReport) for rs in results for r in rs), results
    assert (
        results[2][1].delta_messages == 0
        and results[2][1].bytes_received == results[2][1].bytes_full
    )
    assert results[3][1].delta_messages > 0
    assert (
        results[3][2].delta_messages == 0
        and results[3][2].bytes_received == results[3][2].bytes_full
    )
    assert results[2][2].delta_messages > 0  # back to deltas once it holds v2 again
    for rank in case.dst_ranks:
        assert same(lives[rank], case.reference(canonical(8), values[-1])[rank])
        assert states[rank].holds == 3


def test_a_source_that_keeps_nothing_sends_dense() -> None:
    case = split_case()
    values = versions(2, seed=9)
    states = [DeltaState(keep_previous=False) for _ in range(case.world)]
    results, lives, states = run_versions(case, values, start=canonical(10), states=states)
    assert all(r.delta_messages == 0 for rs in results for r in rs), results
    assert all(s.kept_bytes == 0 for s in states)
    for rank in case.dst_ranks:
        assert same(lives[rank], case.reference(canonical(10), values[-1])[rank])


def test_a_tampered_delta_is_refused_like_a_full_message_then_the_next_delta_lands() -> None:
    case = split_case()
    values = versions(3, seed=11)

    def tamper(rank: int, v: int, group: SyncGroup, state: DeltaState, live: Live) -> None:
        if v == 1 and rank == 0:
            group._pg = _Tamper(group.pg)

    results, lives, _ = run_versions(
        case, values, start=canonical(12), before=tamper, renew_after_error=True
    )
    for rank in range(case.world):
        err = results[rank][1]
        assert isinstance(err, SyncError), results[rank]
        assert err.version == 2
    for rank in (2, 3):
        assert re.search(
            r"the message fails authentication: its MAC does not match", str(results[rank][1])
        )
    # v2 never landed: v3 is a delta against v1 on both sides, and lands exactly
    for rank in case.dst_ranks:
        assert isinstance(results[rank][2], SyncReport) and results[rank][2].delta_messages > 0
        assert same(lives[rank], case.reference(canonical(12), values[-1])[rank])


def test_a_tampered_delta_leaves_the_live_tensors_and_the_states_unchanged() -> None:
    case = split_case()
    values = versions(2, seed=13)

    def tamper(rank: int, v: int, group: SyncGroup, state: DeltaState, live: Live) -> None:
        if v == 1 and rank == 1:
            group._pg = _Tamper(group.pg)

    results, lives, states = run_versions(case, values, start=canonical(14), before=tamper)
    assert all(isinstance(results[r][1], SyncError) for r in range(case.world)), results
    for rank in case.dst_ranks:
        assert same(lives[rank], case.reference(canonical(14), values[0])[rank])
        assert states[rank].holds == 1
    for rank in case.src_ranks:
        assert states[rank].base_version == 1


def test_colocated_delta_copies_locally_at_commit() -> None:
    src = fsdp2_layout(SPEC, ParallelDims(dp=2, tp=2))
    dst = inference_layout(SPEC, ParallelDims(tp=2), vocab_multiple=1)
    case = Case(src, dst, (0, 1, 2, 3), (0, 1))
    values = versions(3, seed=15)
    results, lives, _ = run_versions(case, values, start=canonical(16))
    assert all(isinstance(r, SyncReport) for rs in results for r in rs), results
    assert results[0][2].bytes_copied > 0 and results[0][2].delta_messages > 0
    for rank in case.dst_ranks:
        assert same(lives[rank], case.reference(canonical(16), values[-1])[rank])


def test_a_wire_dtype_other_than_the_live_dtype_is_refused_for_deltas() -> None:
    case = split_case()
    lives = [case.live(r, canonical(0)) for r in range(case.world)]

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        try:
            return send_and_receive(
                case.buckets,
                src_tensors=case.sources(rank, canonical(1)),
                dst_tensors=lives[rank],
                group=group,
                wire_dtype=torch.bfloat16,
                delta=DeltaState(),
            )
        except (SyncError, PlanError) as e:
            return e

    results = run_ranks(case.world, body)
    for rank in case.dst_ranks:
        assert isinstance(results[rank], PlanError)
        assert re.search(
            r"a delta sync writes torch.bfloat16 units into destination tensor '.*', which is "
            r"torch.float32; pass wire_dtype=torch.float32 or none, or sync without delta=",
            str(results[rank]),
        )
    assert all(isinstance(r, SyncError | PlanError) for r in results)


def test_a_version_claim_without_the_groups_mac_reads_as_none() -> None:
    """A process without the secret that writes a claim on the store gets dense messages
    sent, never a delta against a version the receiver does not hold."""
    from areal_fn.runtime.sync.auth import sign
    from areal_fn.runtime.sync.delta import _claims
    from areal_fn.runtime.sync.messages import _message

    group = SyncGroup.from_store(dist.HashStore(), members=[0], rank=0, timeout_s=5)
    t = split_case().plan.transfers[0]
    steps = [(0, [], [_message(0, 1, [t], [torch.float32])], [])]
    store, state = group.store, DeltaState(holds=None)
    store.set(group._key(7, "holds/1"), "5")  # no MAC
    assert _claims(group, 7, 1, steps, state) == {1: -1}
    store.set(
        group._key(8, "holds/1"), sign(b"another key of 32 bytes, not ours", "holds/1", 8, "5")
    )
    assert _claims(group, 8, 1, steps, state) == {1: -1}
    store.set(group._key(9, "holds/1"), sign(group._session, "holds/0", 9, "5"))  # rank 0's
    assert _claims(group, 9, 1, steps, state) == {1: -1}
    store.set(group._key(10, "holds/1"), sign(group._session, "holds/1", 10, "5"))
    assert _claims(group, 10, 1, steps, state) == {1: 5}
