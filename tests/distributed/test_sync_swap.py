"""Weight sync committed by swapping storages (``commit="swap"``), in-process.

Threads over a ``HashStore``, the tiny model of ``test_weight_sync``. Checked: the
result equals the plan's reference semantics bitwise over successive versions, with
the staging kept and handed back, for plain tensors and for parameters (autograd
leaves); the live tensors keep their identity while their memory changes; the memory a live tensor holds after a swap is never handed to the
kernel with the staging (the pages of every mapping the staging still keeps are
dropped, and the live tensors keep their values); a live tensor that shares its
storage is copied into instead; a forged message changes no live tensor, neither its
values nor its memory; bad ``commit`` values are refused.
"""

import mmap
import re
from typing import Any

import pytest
import torch

from areal_fn.errors import PlanError
from areal_fn.runtime.sync import staging
from areal_fn.runtime.sync.delta import DeltaState
from areal_fn.runtime.sync.executor import SyncError, SyncGroup, send_and_receive
from tests.distributed.test_weight_sync import (
    _forge,
    _other_values,
    canonical,
    run_ranks,
    same,
    split_case,
)


def _addresses(live: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: v.untyped_storage().data_ptr() for k, v in live.items()}


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every staging buffer a mapping of its own (this model's are all under 1 MiB)."""
    monkeypatch.setattr(staging, "MAPPED_MIN", 1)


@pytest.mark.parametrize("parameters", [False, True], ids=["tensors", "parameters"])
def test_swapped_commits_equal_the_reference_and_survive_the_staging_handed_back(
    mapped, parameters
) -> None:  # type: ignore[no-untyped-def]
    case = split_case()
    values = [canonical(80 + v) for v in range(4)]
    lives = [case.live(r, values[0]) for r in range(case.world)]
    if parameters:  # an engine's parameters, as autograd leaves
        lives = [{k: torch.nn.Parameter(v) for k, v in live.items()} for live in lives]
    objects = [dict(live) for live in lives]  # the tensor objects the caller holds

    def body(rank: int, store: Any) -> list[tuple[int, bool, bool]]:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        seen = []
        for v, keep in ((1, True), (2, True), (3, False), (1, False)):
            before = _addresses(lives[rank])
            report = send_and_receive(
                case.buckets,
                src_tensors=case.sources(rank, values[v]),
                dst_tensors=lives[rank],
                group=group,
                keep_staging=keep,
                commit="swap",
            )
            b = staging._BUFFERS[group]
            for m in b._maps.values():  # the kernel takes every page the staging holds
                m.madvise(mmap.MADV_DONTNEED)
            want = case.reference(values[0], values[v])[rank]
            now = _addresses(lives[rank])
            moved = bool(now) and all(a != before[k] for k, a in now.items())
            seen.append((report.tensors_swapped, same(lives[rank], want), moved))
        return seen

    seen = run_ranks(case.world, body)
    for rank in range(case.world):
        n = len(lives[rank])
        assert all(lives[rank][k] is t for k, t in objects[rank].items())
        assert all(t.requires_grad == parameters for t in lives[rank].values())
        assert seen[rank] == [(n, True, n > 0)] * 4, (rank, seen[rank])
    assert all(len(lives[r]) > 0 for r in case.dst_ranks)


def test_a_live_tensor_sharing_its_storage_is_copied_into() -> None:
    case = split_case()
    old, new = canonical(90), canonical(91)
    lives = [case.live(r, old) for r in range(case.world)]
    rank = case.dst_ranks[0]
    name = next(iter(lives[rank]))
    t = lives[rank][name]
    room = torch.zeros(t.numel() + 4, dtype=t.dtype)  # a storage larger than the tensor
    room[: t.numel()].copy_(t.reshape(-1))
    lives[rank][name] = shared = room[: t.numel()].view(t.shape)
    address = shared.untyped_storage().data_ptr()

    def body(r: int, store: Any) -> int:
        group = SyncGroup.from_store(store, members=range(case.world), rank=r, timeout_s=10)
        report = send_and_receive(
            case.buckets,
            src_tensors=case.sources(r, new),
            dst_tensors=lives[r],
            group=group,
            commit="swap",
        )
        return report.tensors_swapped

    swapped = run_ranks(case.world, body)
    assert swapped[rank] == len(lives[rank]) - 1
    assert shared.untyped_storage().data_ptr() == address
    for r in case.dst_ranks:
        assert same(lives[r], case.reference(old, new)[r])


def test_a_forged_message_leaves_values_and_memory_unchanged() -> None:
    case = split_case()
    old, new = canonical(92), canonical(93)
    lives = [case.live(r, old) for r in range(case.world)]
    before = [_addresses(live) for live in lives]

    def body(rank: int, store: Any) -> Any:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        _forge(rank, group)
        src = case.sources(rank, new)
        _other_values(rank, src, lives[rank])
        try:
            return send_and_receive(
                case.buckets, src_tensors=src, dst_tensors=lives[rank], group=group, commit="swap"
            )
        except SyncError as e:
            return e

    results = run_ranks(case.world, body)
    assert all(isinstance(r, SyncError) for r in results), results
    assert any("the message fails authentication" in str(r) for r in results)
    for rank in case.dst_ranks:
        assert same(lives[rank], case.live(rank, old)), rank
        assert _addresses(lives[rank]) == before[rank], rank


@pytest.mark.parametrize(
    ("commit", "delta", "message"),
    [
        ("move", False, r"commit='move' is not a way to commit a sync; use one of \['copy', 'swap'\]"),
        ("swap", True, r"commit='swap' with delta=: a delta sync writes its changes .* use commit='copy' with delta"),
    ],
    ids=["unknown", "with-delta"],
)  # fmt: skip
def test_bad_commit_values_are_refused_on_every_member(commit, delta, message) -> None:  # type: ignore[no-untyped-def]
    case = split_case()
    old, new = canonical(94), canonical(95)
    lives = [case.live(r, old) for r in range(case.world)]

    def body(rank: int, store: Any) -> Any:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        try:
            return send_and_receive(
                case.buckets,
                src_tensors=case.sources(rank, new),
                dst_tensors=lives[rank],
                group=group,
                commit=commit,
                delta=DeltaState() if delta else None,
            )
        except (PlanError, SyncError) as e:
            return e

    results = run_ranks(case.world, body)
    assert all(isinstance(r, PlanError) for r in results), results
    assert all(re.search(message, str(r)) for r in results), results
    for rank in case.dst_ranks:
        assert same(lives[rank], case.live(rank, old)), rank
