"""Weight sync (:mod:`areal_fn.runtime.sync.executor`): the executor against the plan's semantics.

Two kinds of tests:

- **in-process** (fast): the members of a sync are threads of this process, each with
  its own gloo process group over one ``HashStore``. The executor's result must equal
  :func:`~areal_fn.plans.transfer.apply.apply_transfers` (the plan's reference semantics)
  bitwise; faults (a stalled sender, another version, other dtypes, a missing
  tensor) must raise ``SyncError``/``PlanError`` on every member and leave every live
  tensor as it was; a renewed group must then sync.
- **torchrun** (one launch of ``sync_worker.py``, 4 processes): a real FSDP2 trainer
  to a DTensor-TP inference model, colocated and not, a stalled and a dead sender
  (see the worker's docstring); the tests below read its records.
"""

import importlib.util
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from areal_fn.errors import PlanError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.plans.transfer import BucketPlan, bucket, plan_rank_transfers, plan_transfers
from areal_fn.plans.transfer.apply import apply_transfers
from areal_fn.plans.transfer.bound import transfer_lower_bound
from areal_fn.runtime.engines.fsdp2_apply import materialize_local
from areal_fn.runtime.sync.auth import SECRET_ENV
from areal_fn.runtime.sync.executor import SyncError, SyncGroup, SyncReport, send_and_receive
from areal_fn.strategy.allocation import ParallelDims
from tests.distributed import sync_worker as worker

SPEC = model_from_hf_config(
    {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 72,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
)


# ---------------------------------------------------------------- in-process harness
def run_ranks(n: int, fn: Callable[[int, dist.Store], Any], *, timeout_s: float = 30) -> list[Any]:
    """Run ``fn(rank, store)`` on ``n`` threads; each result, or the exception it raised."""
    store = dist.HashStore()
    out: list[Any] = [None] * n

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank, store)
        except Exception as e:  # collected for the test to inspect
            out[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def canonical(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {c.name: torch.randn(c.shape, generator=gen).to(dtype) for c in SPEC.tensors}


def locals_of(
    layout: Layout, rank: int, values: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    return {lt.name: materialize_local(lt, values) for lt in layout.local_tensors(rank)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a
    )


class Case:
    """Source and destination layouts on global ranks, their tensors, and the reference."""

    def __init__(
        self,
        src: Layout,
        dst: Layout,
        src_ranks: tuple[int, ...],
        dst_ranks: tuple[int, ...],
        *,
        max_bytes: int = 1500,
        version: int = 1,
    ) -> None:
        self.src, self.dst = src, dst
        self.src_ranks, self.dst_ranks = src_ranks, dst_ranks
        self.world = max(src_ranks + dst_ranks) + 1
        self.plan = plan_transfers(src, dst, src_ranks=src_ranks, dst_ranks=dst_ranks)
        self.buckets = bucket(self.plan, max_bytes, version=version)
        #: from the two layouts alone, not from the plan
        self.lower_bound = transfer_lower_bound(src, dst, src_ranks=src_ranks, dst_ranks=dst_ranks)

    def sources(self, rank: int, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if rank not in self.src_ranks:
            return {}
        return locals_of(self.src, self.src_ranks.index(rank), values)

    def live(self, rank: int, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if rank not in self.dst_ranks:
            return {}
        return locals_of(self.dst, self.dst_ranks.index(rank), values)

    def reference(
        self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
    ) -> list[dict[str, torch.Tensor]]:
        """Every rank's destination tensors after ``apply_transfers`` (in one process)."""
        srcs = {r: self.sources(r, new) for r in range(self.world)}
        dsts = {r: self.live(r, old) for r in range(self.world)}
        apply_transfers(self.plan.transfers, srcs, dsts)  # type: ignore[arg-type]
        return [dsts[r] for r in range(self.world)]


def split_case(**kw: Any) -> Case:
    """Trainer fsdp:d2 on ranks 0-1, inference t2 on ranks 2-3."""
    return Case(
        fsdp2_layout(SPEC, ParallelDims(dp=2)),
        inference_layout(SPEC, ParallelDims(tp=2)),  # vocab padded 72 -> 128: padding rows
        (0, 1),
        (2, 3),
        **kw,
    )


def sync_all(
    case: Case,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    timeout_s: float = 10,
    plan_for: Callable[[int], BucketPlan] | None = None,
    prepare: Callable[[int, dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None,
    on_bucket: Callable[[int, int], None] | None = None,
    wire_dtype: torch.dtype | None = None,
    retry: bool = False,
    on_group: Callable[[int, SyncGroup], None] | None = None,
) -> tuple[list[Any], list[dict[str, torch.Tensor]], list[Any]]:
    """Run one sync on ``case.world`` threads: (results, live tensors, retry results).

    ``on_group(rank, group)`` runs once the group formed (to tamper with it).
    """
    lives = [case.live(r, old) for r in range(case.world)]
    retried: list[Any] = [None] * case.world

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(
            store, members=range(case.world), rank=rank, timeout_s=timeout_s
        )
        if on_group is not None:
            on_group(rank, group)
        src = case.sources(rank, new)
        if prepare is not None:
            prepare(rank, src, lives[rank])
        plan = plan_for(rank) if plan_for is not None else case.buckets
        try:
            result: Any = send_and_receive(
                plan,
                src_tensors=src,
                dst_tensors=lives[rank],
                group=group,
                wire_dtype=wire_dtype,
                on_bucket=None if on_bucket is None else (lambda b: on_bucket(rank, b)),
            )
        except Exception as e:
            result = e
        if retry:
            group = group.renew()
            retried[rank] = send_and_receive(
                case.buckets,
                src_tensors=case.sources(rank, new),
                dst_tensors=lives[rank],
                group=group,
            )
        return result

    return run_ranks(case.world, body), lives, retried


# ---------------------------------------------------------------- in-process tests
def test_sync_equals_the_reference_semantics_and_counts_bytes() -> None:
    case = split_case()
    old, new = canonical(0), canonical(1)
    results, lives, _ = sync_all(case, old, new)
    want = case.reference(old, new)
    for rank, r in enumerate(results):
        assert isinstance(r, SyncReport), r
        assert r.version == 1 and r.buckets == len(case.buckets.buckets)
        assert r.bytes_sent == case.plan.send_bytes().get(rank, 0)
        assert r.bytes_received == case.plan.recv_bytes().get(rank, 0)
        assert r.bytes_copied == 0
        assert same(lives[rank], want[rank])
    assert sum(r.bytes_received for r in results) == case.lower_bound == case.plan.bytes_total
    # padding rows of the vocabulary-padded embeddings keep what they held
    emb = case.dst.local_tensors(1)[0]
    assert emb.name == "model.embed_tokens.weight" and any(p.canonical is None for p in emb.pieces)


def test_colocated_ranks_copy_locally() -> None:
    case = Case(
        fsdp2_layout(SPEC, ParallelDims(dp=2, tp=2)),
        inference_layout(SPEC, ParallelDims(tp=2), vocab_multiple=1),
        (0, 1, 2, 3),
        (0, 1),
    )
    old, new = canonical(2), canonical(3)
    results, lives, _ = sync_all(case, old, new)
    want = case.reference(old, new)
    for rank in (0, 1):
        r = results[rank]
        assert isinstance(r, SyncReport), r
        local = sum(t.nbytes for t in case.plan.transfers if t.is_local and t.dst == rank)
        assert r.bytes_copied == local > 0
        assert r.bytes_received + r.bytes_copied == sum(
            p.local_box.numel * 4 for lt in case.dst.local_tensors(rank) for p in lt.pieces
        )
        assert same(lives[rank], want[rank]) and same(lives[rank], case.live(rank, new))
    assert sum(r.bytes_received for r in results) == case.lower_bound


def test_one_group_carries_successive_versions() -> None:
    case = split_case()
    values = [canonical(40 + v) for v in range(4)]
    lives = [case.live(r, values[0]) for r in range(case.world)]

    def body(rank: int, store: dist.Store) -> list[int]:
        group = SyncGroup.from_store(store, members=range(4), rank=rank, timeout_s=10)
        versions = []
        for v in (1, 2, 3):
            plan = bucket(case.plan, 1500, version=v)
            report = send_and_receive(
                plan,
                src_tensors=case.sources(rank, values[v]),
                dst_tensors=lives[rank],
                group=group,
            )
            versions.append(report.version)
        # the keys of all but the last two syncs are gone from the store
        assert not store.check([group._key(0, f"at/{rank}")]) and store.check(
            [group._key(2, f"at/{rank}")]
        )
        return versions

    assert run_ranks(4, body) == [[1, 2, 3]] * 4
    for rank in case.dst_ranks:
        assert same(lives[rank], case.reference(values[0], values[3])[rank])


def test_megatron_pipeline_to_inference_through_fused_pieces() -> None:
    """Megatron t2p2 (fused ``linear_qkv``/``linear_fc1``, padded vocabulary) -> SGLang t2.

    The sources are what :func:`~areal_fn.plans.convert.to_megatron` gives each rank; no
    conversion runs on the way: the plan's pieces do it.
    """
    case = Case(
        megatron_layout(SPEC, ParallelDims(tp=2, pp=2)),
        inference_layout(SPEC, ParallelDims(tp=2)),
        (0, 1, 2, 3),
        (4, 5),
        max_bytes=4096,
    )
    old, new = canonical(30), canonical(31)
    lives = [case.live(r, old) for r in range(case.world)]

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        src = to_megatron(new, case.src, rank) if rank in case.src_ranks else {}
        return send_and_receive(case.buckets, src_tensors=src, dst_tensors=lives[rank], group=group)

    results = run_ranks(case.world, body)
    assert all(isinstance(r, SyncReport) for r in results), results
    assert any("linear_qkv" in t.src_tensor for t in case.plan.transfers)
    for rank in case.dst_ranks:
        want = case.live(rank, new)  # the new weights; padding rows keep the old (zero) rows
        assert same(lives[rank], want)
        assert results[rank].bytes_received == case.plan.recv_bytes()[rank]


@pytest.mark.parametrize("which", ["megatron_t2p2", "fsdp2_d2"])
def test_each_rank_executing_its_own_plan_equals_the_whole_plan(which: str) -> None:
    """Every rank plans and buckets only its own rows (``plan_rank_transfers``), Megatron
    t2p2 -> SGLang t2 and FSDP2 d2 -> t2: the sync gives the reference result and the
    byte counts of the whole plan, with buckets smaller than one tensor."""
    if which == "fsdp2_d2":
        case = split_case(max_bytes=700)
    else:
        src = megatron_layout(SPEC, ParallelDims(tp=2, pp=2))
        dst = inference_layout(SPEC, ParallelDims(tp=2))
        case = Case(src, dst, (0, 1, 2, 3), (4, 5), max_bytes=1000)
    old, new = canonical(40), canonical(41)
    mine = {
        r: bucket(
            plan_rank_transfers(
                case.src, case.dst, r, src_ranks=case.src_ranks, dst_ranks=case.dst_ranks
            ),
            case.buckets.max_bytes,
            version=1,
        )
        for r in range(case.world)
    }
    lives = [case.live(r, old) for r in range(case.world)]

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(store, members=range(case.world), rank=rank, timeout_s=10)
        src = to_megatron(new, case.src, rank) if rank in case.src_ranks else {}
        return send_and_receive(mine[rank], src_tensors=src, dst_tensors=lives[rank], group=group)

    results = run_ranks(case.world, body)
    assert all(isinstance(r, SyncReport) for r in results), results
    for rank in range(case.world):
        assert results[rank].bytes_sent == case.plan.send_bytes().get(rank, 0)
        assert results[rank].bytes_received == case.plan.recv_bytes().get(rank, 0)
        assert len(mine[rank].buckets) < len(case.buckets.buckets)
    for rank in case.dst_ranks:
        assert same(lives[rank], case.live(rank, new))


def test_wire_dtype_casts_on_the_way() -> None:
    case = split_case()
    old, new = canonical(4), canonical(5)

    def as_bf16(rank: int, src: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
        for k in live:
            live[k] = live[k].to(torch.bfloat16)

    results, lives, _ = sync_all(case, old, new, prepare=as_bf16, wire_dtype=torch.bfloat16)
    want = case.reference(old, new)
    for rank in (2, 3):
        r = results[rank]
        assert isinstance(r, SyncReport), r
        assert r.bytes_received == case.plan.recv_bytes()[rank] // 2  # 2-byte elements travel
        assert same(lives[rank], {k: v.to(torch.bfloat16) for k, v in want[rank].items()})


def _assert_unchanged(
    case: Case, lives: list[dict[str, torch.Tensor]], old: dict[str, torch.Tensor]
) -> None:
    for rank in case.dst_ranks:
        assert same(lives[rank], case.live(rank, old)), f"rank {rank}'s live tensors changed"


def test_a_stalled_sender_fails_every_member_and_changes_nothing_then_renew_syncs() -> None:
    case = split_case()
    old, new = canonical(6), canonical(7)
    k = next(
        b.index
        for b in case.buckets.buckets[1:]
        if any(t.src == 1 and t.dst == 2 for t in b.transfers)
    )

    def stall(rank: int, b: int) -> None:
        if rank == 1 and b == k:
            time.sleep(1.5)

    results, lives, retried = sync_all(case, old, new, timeout_s=0.8, on_bucket=stall, retry=True)
    assert all(isinstance(r, SyncError) for r in results), results
    direct = results[2]
    assert direct.bucket == k and direct.peer == 1 and direct.version == 1
    assert set(direct.tensors) == {
        t.canonical for t in case.buckets.buckets[k].transfers if t.src == 1 and t.dst == 2
    }
    assert f"bucket {k}" in str(direct) and "rank 1" in str(direct)
    assert all(isinstance(r, SyncReport) for r in retried), retried
    want = case.reference(old, new)
    for rank in case.dst_ranks:  # the retry wrote the new version
        assert same(lives[rank], want[rank])


def test_a_stall_leaves_live_tensors_bitwise_unchanged() -> None:
    case = split_case()
    old, new = canonical(8), canonical(9)

    last = max(b.index for b in case.buckets.buckets if any(t.src == 0 for t in b.transfers))

    def stall(rank: int, b: int) -> None:  # in the last bucket: most of v1 already arrived
        if rank == 0 and b == last:
            time.sleep(1.2)

    results, lives, _ = sync_all(case, old, new, timeout_s=0.6, on_bucket=stall)
    assert all(isinstance(r, SyncError) for r in results), results
    _assert_unchanged(case, lives, old)


def test_another_version_is_refused_by_the_receivers() -> None:
    case = split_case(version=4)
    other = bucket(case.plan, 1500, version=5)
    old, new = canonical(10), canonical(11)
    results, lives, _ = sync_all(
        case, old, new, plan_for=lambda r: other if r == 0 else case.buckets
    )
    assert all(isinstance(r, SyncError) for r in results), results
    messages = " ".join(str(r) for r in results)
    assert "the sender syncs version 5, this rank expects version 4" in messages
    _assert_unchanged(case, lives, old)


def test_another_bucketing_is_refused() -> None:
    case = split_case()
    other = bucket(case.plan, 1000, version=1)
    old, new = canonical(12), canonical(13)
    results, lives, _ = sync_all(
        case, old, new, timeout_s=2, plan_for=lambda r: other if r in (0, 1) else case.buckets
    )
    assert all(isinstance(r, SyncError) for r in results), results
    assert all("the sender's transfers differ from this rank's plan" in str(r) for r in results)
    _assert_unchanged(case, lives, old)


def test_other_dtypes_are_refused() -> None:
    case = split_case()
    old, new = canonical(14), canonical(15)

    def half(rank: int, src: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
        for k in src:  # same element size as bfloat16: only the header tells them apart
            src[k] = src[k].to(torch.float16)
        for k in live:
            live[k] = live[k].to(torch.bfloat16)

    results, lives, _ = sync_all(case, old, new, prepare=half)
    assert all(isinstance(r, SyncError) for r in results), results
    assert "the sender's dtypes differ" in " ".join(str(r) for r in results)
    for rank in case.dst_ranks:
        assert same(lives[rank], {k: v.to(torch.bfloat16) for k, v in case.live(rank, old).items()})


def test_a_missing_tensor_is_a_plan_error_and_the_others_fail_fast() -> None:
    case = split_case()
    old, new = canonical(16), canonical(17)

    def drop(rank: int, src: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
        if rank == 3:
            del live["model.norm.weight"]

    start = time.monotonic()
    results, _, _ = sync_all(case, old, new, timeout_s=20, prepare=drop)
    assert time.monotonic() - start < 10  # not the timeout: the failure was published
    assert isinstance(results[3], PlanError)
    assert "needs destination tensor 'model.norm.weight'" in str(results[3])
    assert all(isinstance(r, SyncError) for r in results[:3]), results
    assert "needs destination tensor 'model.norm.weight'" in str(results[2])


def test_a_failing_progress_hook_aborts_every_member() -> None:
    case = split_case()
    old, new = canonical(18), canonical(19)

    def hook(rank: int, b: int) -> None:
        if rank == 2 and b > 0:
            raise ValueError("progress sink is full")

    start = time.monotonic()
    results, lives, _ = sync_all(case, old, new, timeout_s=20, on_bucket=hook)
    assert time.monotonic() - start < 10
    assert isinstance(results[2], ValueError)
    assert all(isinstance(results[r], SyncError) for r in (0, 1, 3)), results
    assert "progress sink is full" in str(results[0])
    _assert_unchanged(case, lives, old)


def test_a_spent_group_must_be_renewed() -> None:
    case = split_case()

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(store, members=range(4), rank=rank, timeout_s=5)
        group.abort()
        assert group.broken and "broken" in repr(group)
        with pytest.raises(SyncError, match=r"spent by an earlier failure; call group\.renew"):
            send_and_receive(case.buckets, src_tensors={}, dst_tensors={}, group=group)
        return group.renew().generation

    assert run_ranks(4, body) == [1, 1, 1, 1]


def test_a_plan_over_ranks_outside_the_group_is_refused() -> None:
    case = split_case()

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(store, members=range(3), rank=rank, timeout_s=5)
        with pytest.raises(
            PlanError, match=r"names ranks \[3\] outside the sync group \[0, 1, 2\]"
        ):
            send_and_receive(case.buckets, src_tensors={}, dst_tensors={}, group=group)

    assert run_ranks(3, body) == [None] * 3


def test_a_member_that_never_arrives_is_named() -> None:
    def body(rank: int, store: dist.Store) -> Any:
        if rank == 0:
            with pytest.raises(SyncError, match=r"members \[1\] did not arrive within 0.5s"):
                SyncGroup.from_store(store, members=(0, 1), rank=0, connect_timeout_s=0.5)

    run_ranks(1, body)


# ---------------------------------------------------------------- authentication
SECRET, OTHER_SECRET = b"the group's secret, 32 bytes long", b"another secret, also 32 bytes ok"


def test_a_member_with_another_secret_is_refused_at_rendezvous_then_the_group_syncs() -> None:
    case = split_case()
    old, new = canonical(50), canonical(51)
    lives = [case.live(r, old) for r in range(4)]

    def body(rank: int, store: dist.Store) -> Any:
        with pytest.raises(SyncError) as refused:
            SyncGroup.from_store(
                store,
                members=range(4),
                rank=rank,
                timeout_s=10,
                secret=OTHER_SECRET if rank == 3 else SECRET,
            )
        # the next generation, with the right secret everywhere
        group = SyncGroup.from_store(
            store, members=range(4), rank=rank, timeout_s=10, secret=SECRET, generation=1
        )
        report = send_and_receive(
            case.buckets, src_tensors=case.sources(rank, new), dst_tensors=lives[rank], group=group
        )
        return refused.value, report

    results = run_ranks(4, body)
    for rank, (err, _) in enumerate(results[:3]):
        assert err.peer == 3 and err.version == -1
        assert re.search(
            rf"sync group 'weight_sync/0': the proof of the group's secret posted for rank 3 "
            rf"does not verify on rank {rank}: the process that joined as rank 3 holds another "
            r"secret than this one, or none\. Refused before any connection or bucket; give "
            r"every member the same secret \(secret= or AREAL_FN_SYNC_SECRET\)",
            str(err),
        ), str(err)
    assert (
        "posted for ranks [0, 1, 2] does not verify on rank 3: the processes that joined as "
        "ranks [0, 1, 2] hold another secret than this one, or none" in str(results[3][0])
    )
    assert all(isinstance(report, SyncReport) for _, report in results)
    want = case.reference(old, new)
    for rank in case.dst_ranks:
        assert same(lives[rank], want[rank])


def _forge(rank: int, group: SyncGroup) -> None:
    if rank == 1:  # speaks the protocol and knows the plan, but not the group's key
        group._session = b"\x00" * 32


def _other_values(rank: int, src: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
    if rank == 1:
        for k in src:
            src[k] = src[k] + 1.0


def test_a_forged_message_is_refused_and_changes_nothing_then_the_next_sync_succeeds() -> None:
    case = split_case()
    old, new = canonical(52), canonical(53)
    start = time.monotonic()
    results, lives, retried = sync_all(
        case, old, new, timeout_s=20, on_group=_forge, prepare=_other_values
    )
    assert time.monotonic() - start < 10  # refused at once, not at the timeout
    assert all(isinstance(r, SyncError) for r in results), results
    direct = [r for r in results[2:] if r.peer == 1]
    assert direct and all(set(r.tensors) for r in direct)
    for r in results[0:1] + results[2:]:
        assert re.search(
            r"on rank [23] receiving from rank 1 \(\d+ transfers of .*\): the message fails "
            r"authentication: its MAC does not match this group's key over the header \(version, "
            r"bucket, sender, receiver, sync\) and the payload's GMAC, so a process without "
            r"the group's secret sent it, or its bytes were altered on the way\. Refused before "
            r"unpacking; live tensors keep the previous version",
            str(r),
        ), str(r)
    _assert_unchanged(case, lives, old)
    # the next legitimate sync, after renew(), lands the new version exactly
    results, lives, retried = sync_all(
        case, old, new, on_group=_forge, prepare=_other_values, retry=True
    )
    assert all(isinstance(r, SyncReport) for r in retried), retried
    want = case.reference(old, new)
    for rank in case.dst_ranks:
        assert same(lives[rank], want[rank])


class _Tamper:
    """A transport that flips the last byte of every buffer it sends (a man in the middle)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work:
        tensors[0][-1] ^= 0xFF
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work:
        return self.inner.recv(tensors, src, tag)

    def abort(self) -> None:
        self.inner.abort()


def test_a_payload_altered_on_the_way_is_refused() -> None:
    case = split_case()
    old, new = canonical(54), canonical(55)

    def tamper(rank: int, group: SyncGroup) -> None:
        if rank == 0:
            group._pg = _Tamper(group.pg)

    results, lives, _ = sync_all(case, old, new, on_group=tamper)
    assert all(isinstance(r, SyncError) for r in results), results
    assert all("receiving from rank 0" in str(r) for r in results), results
    assert all("the message fails authentication" in str(r) for r in results)
    _assert_unchanged(case, lives, old)


def _post_forgeries(store: dist.Store, prefix: str, members: range, *, decision: bool) -> None:
    """What a process without the secret can write: votes, the vote count, a decision."""
    for m in members:
        store.set(f"{prefix}/sync0/vote/{m}", f"vote {m}\n" + "00" * 32)
    store.add(f"{prefix}/sync0/votes", len(members) - 1)
    if decision:
        store.set(f"{prefix}/sync0/decision", "commit")


def test_forged_votes_neither_commit_nor_abort() -> None:
    """Forged votes and an inflated count: the idle member must not commit early (the sync
    then fails in bucket 1 on rank 2; without authenticated votes rank 4 would have
    committed v1 alone, and rank 3, at the vote, with it)."""
    case = split_case()
    old, new = canonical(56), canonical(57)
    lives = [case.live(r, old) for r in range(5)]

    def body(rank: int, store: dist.Store, *, fail: bool, posted: threading.Event) -> Any:
        # 5 threads of one process: on a loaded CI machine one can wait seconds for the GIL
        group = SyncGroup.from_store(store, members=range(5), rank=rank, timeout_s=40)
        if rank == 0:
            _post_forgeries(store, f"{group.name}/{group.generation}", range(5), decision=False)
            posted.set()
        # every member starts after the forgeries are on the store (an event, not a wait
        # on the store: a HashStore.wait begun before the store.add that makes the key
        # was seen to miss it)
        assert posted.wait(40)

        def hook(b: int) -> None:
            if fail and rank == 2 and b > 0:
                time.sleep(0.3)  # let the idle member vote first
                raise ValueError("progress sink is full")

        return send_and_receive(
            case.buckets,
            src_tensors=case.sources(rank, new),
            dst_tensors=lives[rank],
            group=group,
            on_bucket=hook,
        )

    first, second = threading.Event(), threading.Event()
    results = run_ranks(5, lambda r, st: body(r, st, fail=True, posted=first), timeout_s=120)
    assert isinstance(results[2], ValueError)
    assert all(isinstance(results[r], SyncError) for r in (0, 1, 3, 4)), results
    assert "progress sink is full" in str(results[4])
    _assert_unchanged(case, lives, old)
    results = run_ranks(5, lambda r, st: body(r, st, fail=False, posted=second), timeout_s=120)
    assert all(isinstance(r, SyncReport) for r in results), results
    want = case.reference(old, new)
    for rank in case.dst_ranks:
        assert same(lives[rank], want[rank])


def test_a_forged_decision_does_not_commit_and_the_renewed_group_syncs() -> None:
    case = split_case()
    old, new = canonical(58), canonical(59)

    def forge(rank: int, group: SyncGroup) -> None:
        if rank == 0:
            _post_forgeries(group.store, f"{group.name}/0", range(4), decision=True)

    results, lives, retried = sync_all(case, old, new, on_group=forge, retry=True)
    assert all(isinstance(r, SyncError) for r in results), results
    assert all(
        "the decision posted on the store for sync 0 of 'weight_sync' generation 0 does not "
        "carry this group's MAC (a process without the group's secret wrote it), so no member "
        "commits on it" in str(r)
        for r in results
    ), results
    assert all(isinstance(r, SyncReport) for r in retried), retried
    want = case.reference(old, new)
    for rank in case.dst_ranks:
        assert same(lives[rank], want[rank])


# ---------------------------------------------------------------- torchrun
WORKER = Path(__file__).with_name("sync_worker.py")
REPO = Path(__file__).resolve().parents[2]
WORLD = 4
#: the worker's model: every rank checks each of its canonical tensors
N_TENSORS = len(model_from_hf_config(worker.CONFIG).tensors)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from areal_fn.runtime.launch import run_torchrun

    out = tmp_path_factory.mktemp("weight_sync")
    result = run_torchrun(
        WORKER, ["--out", str(out)], nproc=WORLD, timeout_s=600, cwd=REPO, check=False
    )
    recs = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.exists(), result.report()
        recs.append(json.loads(path.read_text()))
    assert result.ok or any(rec["failures"] for rec in recs), result.report()
    return recs


@needs_transformers
class TestLaunch:
    """Read the records of one ``sync_worker.py`` launch."""

    pytestmark: ClassVar = [
        pytest.mark.dist,
        pytest.mark.slow,
        pytest.mark.xdist_group("weight_sync"),
    ]

    def test_no_check_failed(self, records: list[dict[str, Any]]) -> None:
        for rec in records:
            assert rec["world_size"] == WORLD
            assert rec["failures"] == [], json.dumps(rec["failures"][:5], indent=1)

    def test_tp_engine_holds_the_inference_layout(self, records: list[dict[str, Any]]) -> None:
        for rank in (2, 3):
            c = records[rank]["counts"]
            n = c["engine.tensors"]
            assert n == N_TENSORS
            assert c["engine.layout_data.checked"] == n
            assert c["engine.layout_names.checked"] == c["engine.layout_shapes.checked"] == 1

    def test_split_sync_bytes_and_logits(self, records: list[dict[str, Any]]) -> None:
        plan = records[0]["measured"]["split.plan"]
        assert plan["bytes_total"] == plan["lower_bound"]
        for rank in (2, 3):
            rep = records[rank]["reports"]["split"]
            assert rep["version"] == 1
            assert (
                rep["bytes_received"]
                == plan["shard_bytes"][str(rank)]
                == plan["recv_bytes"][str(rank)]
            )
            assert records[rank]["counts"]["split.weights.checked"] == N_TENSORS
            assert records[rank]["measured"]["split.logits_max_abs_diff"] <= 2e-6
        for rank in (0, 1):
            assert records[rank]["reports"]["split"]["bytes_sent"] == plan["send_bytes"][str(rank)]
        assert (
            sum(rec["reports"]["split"]["bytes_received"] for rec in records) == plan["lower_bound"]
        )
        assert records[0]["counts"]["split.full_tensor.checked"] == N_TENSORS

    def test_stalled_sender(self, records: list[dict[str, Any]]) -> None:
        k = records[0]["measured"]["stall.bucket"]
        assert k > 0
        for rec in records:
            err = rec["errors"]["stall"]
            assert err["version"] == 2
            assert rec["reports"]["stall.retry"]["version"] == 2
        direct = records[2]["errors"]["stall"]
        assert (direct["bucket"], direct["peer"]) == (k, 1)
        assert direct["tensors"] == records[0]["measured"]["stall.tensors"]["2"]
        assert "Timed out" in direct["message"]
        for rank in (2, 3):
            c = records[rank]["counts"]
            assert c["stall.unchanged.checked"] == c["stall.retry_weights.checked"] == N_TENSORS
            assert records[rank]["measured"]["stall.retry.logits_max_abs_diff"] <= 2e-6

    def test_colocated_sync_copies_locally(self, records: list[dict[str, Any]]) -> None:
        plan = records[0]["measured"]["colocated.plan"]
        assert plan["bytes_total"] == plan["lower_bound"]
        for rank in (0, 1):
            rep = records[rank]["reports"]["colocated"]
            assert rep["bytes_copied"] == plan["local_bytes"][str(rank)] > 0
            assert rep["bytes_received"] + rep["bytes_copied"] == plan["shard_bytes"][str(rank)]
            assert records[rank]["measured"]["colocated.logits_max_abs_diff"] <= 2e-6
        assert (
            sum(rec["reports"]["colocated"]["bytes_received"] for rec in records)
            == plan["lower_bound"]
        )

    def test_launcher_gives_every_rank_one_fresh_secret(
        self, records: list[dict[str, Any]]
    ) -> None:
        secrets = [rec["measured"]["auth.secret"] for rec in records]
        assert all(s == secrets[0] for s in secrets) and secrets[0]["length"] == 64
        assert secrets[0]["sha256"] != worker.sha256_hex(os.environ.get(SECRET_ENV, ""))

    def test_a_member_with_another_secret_is_refused_and_named(
        self, records: list[dict[str, Any]]
    ) -> None:
        for rank in (0, 1, 2):
            err = records[rank]["errors"]["auth.rendezvous"]
            assert err["peer"] == 3
            assert re.search(
                rf"sync group 'auth/0': the proof of the group's secret posted for rank 3 does "
                rf"not verify on rank {rank}: the process that joined as rank 3 holds another "
                r"secret than this one, or none\. Refused before any connection or bucket",
                err["message"],
            ), err["message"]
        stray = records[3]["errors"]["auth.rendezvous"]
        assert "posted for ranks [0, 1, 2] does not verify on rank 3" in stray["message"]

    def test_a_forged_sender_changes_nothing_and_the_next_sync_succeeds(
        self, records: list[dict[str, Any]]
    ) -> None:
        for rec in records:
            assert rec["errors"]["auth.forged"]["version"] == 3
            assert rec["reports"]["auth.retry"]["version"] == 3
        direct = [records[r]["errors"]["auth.forged"] for r in (2, 3)]
        assert any(e["peer"] == 1 for e in direct), direct
        for e in direct + [records[0]["errors"]["auth.forged"]]:
            assert "receiving from rank 1" in e["message"], e["message"]
            assert "the message fails authentication: its MAC does not match" in e["message"]
        for rank in (2, 3):
            c = records[rank]["counts"]
            assert c["auth.unchanged.checked"] == c["auth.retry_weights.checked"] == N_TENSORS
            assert records[rank]["measured"]["auth.retry.logits_max_abs_diff"] <= 2e-6

    def test_dead_sender(self, records: list[dict[str, Any]]) -> None:
        assert records[1]["measured"]["death.exited"] is True
        k = records[0]["measured"]["death.bucket"]
        assert k > 0
        for rank in (0, 2, 3):
            assert records[rank]["errors"]["death"]["version"] == 4
            assert records[rank]["reports"]["death.retry"]["version"] == 4
            assert records[rank]["measured"]["death.generation"] == 1
        direct = records[2]["errors"]["death"]
        assert (direct["bucket"], direct["peer"]) == (k, 1)
        assert direct["tensors"] == records[0]["measured"]["death.tensors"]["2"]
        for rank in (2, 3):
            c = records[rank]["counts"]
            assert c["death.unchanged.checked"] == c["death.retry_weights.checked"] == N_TENSORS
            assert records[rank]["measured"]["death.retry.logits_max_abs_diff"] <= 2e-6

    def test_delta_syncs_equal_full_syncs_after_adamw_steps(
        self, records: list[dict[str, Any]]
    ) -> None:
        steps = [f"delta.v{v}" for v in (11, 12, 13)] + ["delta.mismatch", "delta.after_tamper"]
        for rank in (2, 3):
            c = records[rank]["counts"]
            n = c["delta.equals_full.checked"]
            assert n == c["delta.equals_trained.checked"] == 5 * N_TENSORS
            reps = records[rank]["reports"]
            assert all(s in reps and f"{s}.full" in reps for s in steps), sorted(reps)
            first = reps["delta.v11"]
            assert first["delta_messages"] == 0
            assert (
                first["bytes_received"]
                == first["bytes_full"]
                == reps["delta.v11.full"]["bytes_received"]
            )
            for s in ("delta.v12", "delta.v13", "delta.after_tamper"):
                assert reps[s]["delta_messages"] > 0
                assert reps[s]["bytes_full"] == reps[f"{s}.full"]["bytes_received"]
                assert reps[s]["bytes_received"] < 0.5 * reps[s]["bytes_full"], reps[s]
        for rank in (0, 1):
            assert records[rank]["measured"]["delta.kept_bytes"] > 0

    def test_a_delta_version_mismatch_falls_back_to_full(
        self, records: list[dict[str, Any]]
    ) -> None:
        stray, kept = (
            records[2]["reports"]["delta.mismatch"],
            records[3]["reports"]["delta.mismatch"],
        )
        assert stray["delta_messages"] == 0 and stray["bytes_received"] == stray["bytes_full"]
        assert kept["delta_messages"] > 0 and kept["bytes_received"] < kept["bytes_full"]

    def test_a_tampered_delta_is_refused_like_a_tampered_full_message(
        self, records: list[dict[str, Any]]
    ) -> None:
        for rec in records:
            assert rec["errors"]["delta.tampered"]["version"] == 15
        direct = [records[r]["errors"]["delta.tampered"] for r in (2, 3)]
        assert any(e["peer"] == 0 for e in direct), direct
        for e in direct:
            assert "the message fails authentication: its MAC does not match" in e["message"]
        for rank in (2, 3):
            assert records[rank]["counts"]["delta.tampered_unchanged.checked"] == N_TENSORS
            assert records[rank]["measured"]["delta.holds_after_tamper"] == 14
