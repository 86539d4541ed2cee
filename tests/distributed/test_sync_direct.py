"""Weight sync with boxes that travel on their own (in-process, threads over a HashStore).

A box of at least ``messages.DIRECT_BYTES`` travels as an operation of its own: sent
from the source tensor and received into the shadow where its region there is
contiguous and of the wire dtype, packed and unpacked otherwise. The tiny model of
``test_weight_sync`` has no box that large, so these tests lower the threshold to one
byte (every box on its own) and check the same facts as there: the result equals the
plan's reference semantics bitwise, casts work, the staging memory a group keeps
carries successive versions, and a forged or altered message changes nothing.
"""

import mmap
from collections.abc import Iterator

import pytest
import torch

from areal_fn.runtime.sync import messages, staging
from areal_fn.runtime.sync.executor import SyncError, SyncGroup, SyncReport, send_and_receive
from tests.distributed.test_weight_sync import (
    _assert_unchanged,
    _forge,
    _other_values,
    _Tamper,
    canonical,
    run_ranks,
    same,
    split_case,
    sync_all,
)


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bool, int, int]]]:
    """Every box on its own; yields, per message prepared, (on the sending side, boxes
    moved in place, boxes on their own)."""
    seen: list[tuple[bool, int, int]] = []
    real = messages._direct

    def counted(m, tensors, *, source):  # type: ignore[no-untyped-def]
        out = real(m, tensors, source=source)
        seen.append((source, len(out), sum(i >= 0 for _, _, i in m.ops)))
        return out

    monkeypatch.setattr(messages, "DIRECT_BYTES", 1)
    monkeypatch.setattr(messages, "_direct", counted)
    yield seen


def test_boxes_sent_and_received_in_place_equal_the_reference(direct) -> None:  # type: ignore[no-untyped-def]
    case = split_case()
    old, new = canonical(60), canonical(61)
    results, lives, _ = sync_all(case, old, new)
    want = case.reference(old, new)
    for rank, r in enumerate(results):
        assert isinstance(r, SyncReport), r
        assert r.bytes_received == case.plan.recv_bytes().get(rank, 0)
        assert same(lives[rank], want[rank])
    for side in (True, False):
        moved = sum(n for s, n, _ in direct if s == side)
        alone = sum(k for s, _, k in direct if s == side)
        assert 0 < moved, side  # boxes travelled from the sources / into the shadows
        if side:  # row-parallel weights are strided in fsdp:d2 sources: packed
            assert moved < alone


def test_a_cast_on_the_way_is_packed_and_received_in_place(direct) -> None:  # type: ignore[no-untyped-def]
    case = split_case()
    old, new = canonical(62), canonical(63)

    def as_bf16(rank, src, live):  # type: ignore[no-untyped-def]
        for k in live:
            live[k] = live[k].to(torch.bfloat16)

    results, lives, _ = sync_all(case, old, new, prepare=as_bf16, wire_dtype=torch.bfloat16)
    want = case.reference(old, new)
    for rank in case.dst_ranks:
        assert isinstance(results[rank], SyncReport), results[rank]
        assert same(lives[rank], {k: v.to(torch.bfloat16) for k, v in want[rank].items()})
    assert sum(n for s, n, _ in direct if s) == 0  # fp32 sources: every box is cast, packed
    assert sum(n for s, n, _ in direct if not s) > 0  # bf16 shadows: received in place


@pytest.mark.parametrize("mapped_min", [staging.MAPPED_MIN, 1], ids=["heap", "mapped"])
def test_one_group_and_its_staging_memory_carry_successive_versions(
    direct, monkeypatch, mapped_min
) -> None:  # type: ignore[no-untyped-def]
    """Kept while asked to; handed back by a sync that does not keep it (the default):
    plain buffers freed, mapped ones kept with their pages given to the kernel. A sync
    after the kernel took those pages (``MADV_DONTNEED``: they come back zeroed) is still
    exact."""
    monkeypatch.setattr(staging, "MAPPED_MIN", mapped_min)
    case = split_case()
    values = [canonical(64 + v) for v in range(4)]
    lives = [case.live(r, values[0]) for r in range(case.world)]

    def body(rank, store):  # type: ignore[no-untyped-def]
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        held = []
        for v, keep in ((1, True), (2, True), (1, False), (3, False)):
            send_and_receive(
                case.buckets,
                src_tensors=case.sources(rank, values[v]),
                dst_tensors=lives[rank],
                group=group,
                keep_staging=keep,
            )
            assert same(lives[rank], case.reference(values[0], values[v])[rank]), (rank, v)
            b = staging._BUFFERS[group]
            held.append(len(b._flat) + len(b._shadows))
            if not keep:  # the kernel takes every page handed back
                for m in b._maps.values():
                    m.madvise(mmap.MADV_DONTNEED)
        return held

    held = run_ranks(case.world, body)
    for rank, counts in enumerate(held):
        assert counts[0] == counts[1] > 0, (rank, counts)
        if mapped_min > 1:  # this model's buffers are all under 1 MiB: freed
            assert counts[2:] == [0, 0], (rank, counts)
        else:  # every buffer is mapped: kept
            assert counts[2:] == counts[:2], (rank, counts)


def test_a_forged_message_is_refused_with_boxes_in_place(direct) -> None:  # type: ignore[no-untyped-def]
    case = split_case()
    old, new = canonical(70), canonical(71)
    results, lives, _ = sync_all(case, old, new, on_group=_forge, prepare=_other_values)
    assert all(isinstance(r, SyncError) for r in results), results
    assert any("receiving from rank 1" in str(r) for r in results)
    assert any("the message fails authentication" in str(r) for r in results)
    _assert_unchanged(case, lives, old)


def test_a_payload_altered_on_the_way_is_refused_with_boxes_in_place(direct) -> None:  # type: ignore[no-untyped-def]
    case = split_case()
    old, new = canonical(72), canonical(73)

    def tamper(rank, group):  # type: ignore[no-untyped-def]
        if rank == 0:
            group._pg = _Tamper(group.pg)

    results, lives, _ = sync_all(case, old, new, on_group=tamper)
    assert all(isinstance(r, SyncError) for r in results), results
    assert all("receiving from rank 0" in str(r) for r in results)
    assert all("the message fails authentication" in str(r) for r in results)
    _assert_unchanged(case, lives, old)
