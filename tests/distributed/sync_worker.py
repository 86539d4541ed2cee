"""torchrun worker: weight sync from a real FSDP2 trainer to a DTensor-TP inference model.

Launched once by ``tests/distributed/test_weight_sync.py`` with 4 ranks (gloo, CPU). Checks
never raise (a rank that raised would leave the others waiting): they record, and
``<out>/rank<r>.json`` gets counts, failures, sync reports, errors and measurements.

Sections, in order (each needs the ranks alive that the previous ones left):

``split``
    trainer ``fsdp:d2`` on ranks 0-1 (a tiny Qwen2 under :func:`apply_fsdp2`), inference
    ``t2`` on ranks 2-3 (:mod:`areal_fn.runtime.engines.tp`, different initial weights).
    The inference model's local tensors are checked against
    ``inference_layout(..., vocab_multiple=1)`` (names, shapes, contents). One AdamW
    step, then sync v1 over :meth:`SyncGroup.from_world`: bytes, bitwise weights, logits
    against an unsharded model holding the trained canonical weights.
``stall``
    a second step; sync v2 while rank 1 sleeps past the timeout at the start of bucket
    ``k > 0``: every rank raises ``SyncError`` (receivers naming bucket ``k``, peer 1
    and the tensors), the inference weights stay v1 bitwise; then ``renew()`` and v2
    succeeds.
``delta``
    the trainer's AdamW at an RL learning rate (1e-5), fp32, synced as bf16
    (``wire_dtype``) into plain bf16 tensors of the inference layout on ranks 2-3, each
    version twice, over two groups: a full sync and a delta sync
    (``delta=DeltaState()``); after each, the two are compared bitwise with each
    other and with the trained weights. v11 goes full (no version held), v12-13 as
    deltas; in v14 rank 2 claims a version no source kept (its messages go dense, rank
    3's stay deltas); v15's delta messages are altered on the way from rank 0: every
    rank raises, the delta tensors stay v14 bitwise; after ``renew()`` v16 lands as
    a delta against v14.
``colocated``
    trainer ``fsdp:d2t2`` on ranks 0-3, inference ``t2`` on ranks 0-1 (local copies).
``auth``
    standalone groups over a ``TCPStore``, authenticated. Every rank holds the secret
    ``run_torchrun`` generated (``AREAL_FN_SYNC_SECRET``). Rank 3 first joins with
    another secret: every rank raises ``SyncError`` at rendezvous, naming rank 3 (rank 3
    names the others). The next generation forms with the right secret; rank 1 then
    sends forged messages (the right format, other values, a MAC under a key that is
    not the group's) in sync v3: every rank raises, receivers naming peer 1, and the
    inference weights stay v2 bitwise; after ``renew()`` v3 succeeds.
``death``
    a standalone group over a ``TCPStore``; sources are full replicas on ranks 0 and 1;
    rank 1 ``os._exit``\\ s at the start of bucket ``k > 0``: ranks 0, 2, 3 raise
    ``SyncError``, the weights stay v3 bitwise; the survivors renew the group without
    rank 1, re-plan from rank 0 alone, and v4 succeeds.
"""

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.layouts.fsdp2 import fsdp2_layout  # noqa: E402
from areal_fn.layouts.inference import inference_layout  # noqa: E402
from areal_fn.layouts.layout import Layout  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.model.tensor_spec import DTYPE_BYTES  # noqa: E402
from areal_fn.plans.transfer import BucketPlan, bucket, plan_transfers  # noqa: E402
from areal_fn.plans.transfer.bound import transfer_lower_bound  # noqa: E402
from areal_fn.runtime.engines import tp as tp_engine  # noqa: E402
from areal_fn.runtime.engines.fsdp2_apply import (  # noqa: E402
    apply_fsdp2,
    export_canonical,
    init_mesh,
    materialize_local,
)
from areal_fn.runtime.sync.auth import SECRET_ENV  # noqa: E402
from areal_fn.runtime.sync.executor import (  # noqa: E402
    DeltaState,
    SyncError,
    SyncGroup,
    SyncReport,
    open_store,
    send_and_receive,
)
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

WORLD = 4
#: untied, with q/k/v biases; heads, KV heads, MLP width and vocabulary divisible by 2.
CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
BUCKET_BYTES = 2048
TIMEOUT_S = 8.0  # generous: the machine may be shared and loaded
STALL_S = 12.0
LR = 1e-2
BATCH, SEQ = 4, 8
TRAINER, INFER = (0, 1), (2, 3)


def spec() -> ModelSpec:
    return model_from_hf_config(CONFIG)


def build_model(s: ModelSpec, seed: int) -> nn.Module:
    """A transformers model of ``s`` with seeded random values in every parameter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(s.hf_config())
    config = AutoConfig.for_model(str(hf.pop("model_type")), **hf)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def reference_logits(s: ModelSpec, canonical: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Logits of an unsharded model holding ``canonical`` (names = HF names, untied)."""
    model = build_model(s, seed=0)
    model.load_state_dict(dict(canonical), strict=True)
    with torch.no_grad():
        return model(input_ids=eval_ids()).logits


def eval_ids() -> torch.Tensor:
    return torch.randint(
        0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(7)
    )


def train_ids() -> torch.Tensor:
    return torch.randint(
        0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3)
    )


def shard_bytes(layout: Layout, rank: int) -> int:
    """Bytes of ``rank``'s local tensors that hold canonical data (padding excluded)."""
    return sum(
        p.local_box.numel * DTYPE_BYTES[lt.dtype]
        for lt in layout.local_tensors(rank)
        for p in lt.pieces
        if p.canonical is not None
    )


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Recorder:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.counts: dict[str, int] = {}
        self.failures: list[dict[str, Any]] = []
        self.reports: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, dict[str, Any]] = {}
        self.measured: dict[str, Any] = {}
        self.timings: dict[str, float] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def check(self, ok: bool, key: str, **details: Any) -> None:
        self.count(key + ".checked")
        if not ok:
            self.fail(key, **details)

    def fail(self, key: str, **details: Any) -> None:
        self.count(key + ".failed")
        if len(self.failures) < 200:
            self.failures.append({"check": key, **{k: str(v) for k, v in details.items()}})

    def report(self, key: str, r: SyncReport) -> None:
        self.reports[key] = {
            "version": r.version,
            "bytes_sent": r.bytes_sent,
            "bytes_received": r.bytes_received,
            "bytes_copied": r.bytes_copied,
            "overhead_bytes": r.overhead_bytes,
            "buckets": r.buckets,
            "messages": r.messages,
            "seconds": round(r.seconds, 4),
            "bytes_full": r.bytes_full,
            "delta_messages": r.delta_messages,
        }

    def error(self, key: str, e: SyncError, seconds: float) -> None:
        self.errors[key] = {
            "message": str(e),
            "version": e.version,
            "bucket": e.bucket,
            "peer": e.peer,
            "tensors": list(e.tensors),
            "seconds": round(seconds, 3),
        }

    def dump(self, out: Path, world: int, **extra: Any) -> None:
        out.mkdir(parents=True, exist_ok=True)
        data = {
            "rank": self.rank,
            "world_size": world,
            "counts": self.counts,
            "failures": self.failures,
            "reports": self.reports,
            "errors": self.errors,
            "measured": self.measured,
            "timings": self.timings,
            **extra,
        }
        (out / f"rank{self.rank}.json").write_text(json.dumps(data, indent=1, sort_keys=True))


def guarded(rec: Recorder, section: str, fn: Callable[[], None]) -> None:
    start = time.monotonic()
    try:
        fn()
    except Exception:
        rec.fail(section, error=traceback.format_exc(limit=12))
    rec.timings[section] = round(time.monotonic() - start, 3)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def broadcast_canonical(canonical: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank 0's canonical tensors on every rank of the world (tiny models only)."""
    box: list[Any] = [canonical]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_bucket_from(plan: BucketPlan, src: int, dst: int = 2) -> int:
    """The first bucket after bucket 0 in which ``src`` sends to ``dst`` (the rank whose
    error the stall test reads: it must be waiting on ``src`` in that bucket)."""
    for b in plan.buckets[1:]:
        if any(t.src == src and t.dst == dst for t in b.transfers):
            return b.index
    raise RuntimeError(f"no bucket > 0 in which rank {src} sends to rank {dst}")


def expected_failure(plan: BucketPlan, k: int, src: int) -> dict[str, list[str]]:
    """Per destination rank: the canonical tensors ``src`` sends it in bucket ``k``."""
    return {
        str(d): sorted(
            {t.canonical for t in plan.buckets[k].transfers if t.src == src and t.dst == d}
        )
        for d in INFER
    }


def check_live(
    rec: Recorder,
    key: str,
    live: Mapping[str, torch.Tensor],
    layout: Layout,
    rank: int,
    canonical: Mapping[str, torch.Tensor],
) -> None:
    for lt in layout.local_tensors(rank):
        rec.check(same(live[lt.name], materialize_local(lt, canonical)), key, tensor=lt.name)


def check_logits(rec: Recorder, key: str, model: nn.Module, want: torch.Tensor) -> None:
    with torch.no_grad():
        got = model(input_ids=eval_ids()).logits
    diff = float((got - want).abs().max())
    rec.measured[f"{key}.logits_max_abs_diff"] = diff
    rec.measured[f"{key}.logits_max_abs"] = float(want.abs().max())
    rec.check(tuple(got.shape) == tuple(want.shape) and diff <= 2e-6, key + ".logits", diff=diff)


# ---------------------------------------------------------------- sections
class State:
    """What later sections reuse from earlier ones."""

    def __init__(self, meshes: dict[str, DeviceMesh]) -> None:
        self.meshes = meshes
        self.trainer: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.infer: nn.Module | None = None
        self.fsdp: Layout | None = None
        self.infer_layout: Layout | None = None
        self.canonical: dict[str, torch.Tensor] = {}  # the newest synced version, every rank
        self.group: SyncGroup | None = None


def trainer_step(st: State, rank: int) -> dict[str, torch.Tensor] | None:
    """One AdamW step of the d2 trainer; the trained canonical weights on rank 0."""
    assert st.trainer is not None and st.optimizer is not None and st.fsdp is not None
    ids = train_ids()
    half = ids[rank * BATCH // 2 : (rank + 1) * BATCH // 2]
    st.optimizer.zero_grad()
    lm_loss(st.trainer(input_ids=half).logits, half).backward()
    st.optimizer.step()
    group = st.meshes["d2"].get_group()
    canonical = export_canonical(st.trainer, st.fsdp, group=group)
    return canonical if rank == 0 else None


def section_split(rec: Recorder, st: State) -> None:
    rank, meshes = rec.rank, st.meshes
    s = spec()
    st.fsdp = fsdp2_layout(s, ParallelDims(dp=2))
    st.infer_layout = inference_layout(s, ParallelDims(tp=2), vocab_multiple=1)
    if rank in TRAINER:
        st.trainer = apply_fsdp2(build_model(s, seed=1), st.fsdp, meshes["d2"])
        st.optimizer = torch.optim.AdamW(st.trainer.parameters(), lr=LR)
    else:
        model = build_model(s, seed=2)
        before = {n: p.detach().clone() for n, p in model.state_dict().items()}
        st.infer = tp_engine.apply_tp(model, st.infer_layout, meshes["tp23"])
        lrank = tp_engine.layout_rank(meshes["tp23"])
        rec.check(lrank == rank - 2, "engine.layout_rank", got=lrank)
        problems = tp_engine.check_applied(st.infer, st.infer_layout, lrank)
        rec.check(problems == [], "engine.layout_shapes", problems=problems[:10])
        local = tp_engine.local_tensors(st.infer)
        want = st.infer_layout.local_tensors(lrank)
        rec.check(list(local) == [lt.name for lt in want], "engine.layout_names")
        for lt in want:
            rec.check(
                same(local[lt.name], materialize_local(lt, before)),
                "engine.layout_data",
                tensor=lt.name,
            )
            rec.count("engine.tensors")
    canonical = trainer_step(st, rank) if rank in TRAINER else None
    if rank in TRAINER:  # the gather by pieces agrees with DTensor's own full_tensor()
        assert st.trainer is not None
        full = {
            n: p.full_tensor() for n, p in st.trainer.named_parameters() if isinstance(p, DTensor)
        }
        if rank == 0 and canonical is not None:
            for n, t in full.items():
                rec.check(same(t, canonical[n]), "split.full_tensor", tensor=n)
    st.canonical = broadcast_canonical(canonical)

    plan = plan_transfers(st.fsdp, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER)
    bp = bucket(plan, BUCKET_BYTES, version=1)
    rec.measured["split.plan"] = {
        "lower_bound": transfer_lower_bound(
            st.fsdp, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER
        ),
        "bytes_total": plan.bytes_total,
        "recv_bytes": {str(k): v for k, v in plan.recv_bytes().items()},
        "send_bytes": {str(k): v for k, v in plan.send_bytes().items()},
        "buckets": len(bp.buckets),
        "shard_bytes": {str(g): shard_bytes(st.infer_layout, i) for i, g in enumerate(INFER)},
    }
    st.group = SyncGroup.from_world(range(WORLD), timeout_s=TIMEOUT_S, connect_timeout_s=60)
    report = send_and_receive(
        bp, src_tensors=sources(st, rank), dst_tensors=destinations(st, rank), group=st.group
    )
    rec.report("split", report)
    if rank in INFER:
        assert st.infer is not None
        check_live(
            rec,
            "split.weights",
            tp_engine.local_tensors(st.infer),
            st.infer_layout,
            rank - 2,
            st.canonical,
        )
        check_logits(rec, "split", st.infer, reference_logits(s, st.canonical))


def sources(st: State, rank: int) -> dict[str, torch.Tensor]:
    if rank not in TRAINER or st.trainer is None:
        return {}
    return tp_engine.local_tensors(st.trainer)


def destinations(st: State, rank: int) -> dict[str, torch.Tensor]:
    if rank not in INFER or st.infer is None:
        return {}
    return tp_engine.local_tensors(st.infer)


def section_stall(rec: Recorder, st: State) -> None:
    rank = rec.rank
    s = spec()
    assert st.fsdp is not None and st.infer_layout is not None and st.group is not None
    previous = st.canonical
    canonical = trainer_step(st, rank) if rank in TRAINER else None
    new = broadcast_canonical(canonical)
    plan = plan_transfers(st.fsdp, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER)
    bp = bucket(plan, BUCKET_BYTES, version=2)
    k = first_bucket_from(bp, 1)
    rec.measured["stall.bucket"] = k
    rec.measured["stall.tensors"] = expected_failure(bp, k, 1)

    def stall(b: int) -> None:
        if rank == 1 and b == k:
            time.sleep(STALL_S)

    dist.barrier()
    start = time.monotonic()
    try:
        send_and_receive(
            bp,
            src_tensors=sources(st, rank),
            dst_tensors=destinations(st, rank),
            group=st.group,
            on_bucket=stall,
        )
        rec.fail("stall.raised", what="the stalled sync returned")
    except SyncError as e:
        rec.error("stall", e, time.monotonic() - start)
    if rank in INFER:
        assert st.infer is not None
        check_live(
            rec,
            "stall.unchanged",
            tp_engine.local_tensors(st.infer),
            st.infer_layout,
            rank - 2,
            previous,
        )
    start = time.monotonic()
    st.group = st.group.renew()
    rec.measured["stall.renew_s"] = round(time.monotonic() - start, 3)
    report = send_and_receive(
        bp, src_tensors=sources(st, rank), dst_tensors=destinations(st, rank), group=st.group
    )
    rec.report("stall.retry", report)
    st.canonical = new
    if rank in INFER:
        assert st.infer is not None
        check_live(
            rec,
            "stall.retry_weights",
            tp_engine.local_tensors(st.infer),
            st.infer_layout,
            rank - 2,
            new,
        )
        check_logits(rec, "stall.retry", st.infer, reference_logits(s, new))


DELTA_LR = 1e-5  # an RL learning rate: most bf16 weights do not change in a step
DELTA_STEPS = 3


class Tamper:
    """A transport that flips the last byte of every buffer it sends (a man in the middle)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Any:
        tensors[0][-1] ^= 0xFF
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Any:
        return self.inner.recv(tensors, src, tag)

    def abort(self) -> None:
        self.inner.abort()


def _bf16_live(
    st: State, rank: int, canonical: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if rank not in INFER:
        return {}
    assert st.infer_layout is not None
    bf16 = {n: t.to(torch.bfloat16) for n, t in canonical.items()}
    return {lt.name: materialize_local(lt, bf16) for lt in st.infer_layout.local_tensors(rank - 2)}


def _delta_round(
    rec: Recorder,
    st: State,
    groups: dict[str, SyncGroup],
    lives: dict[str, dict[str, torch.Tensor]],
    state: DeltaState,
    version: int,
    key: str,
) -> None:
    """One AdamW step, then sync ``version`` both ways (full, delta) and compare bitwise
    with each other and with the trained weights in bf16."""
    rank = rec.rank
    assert st.fsdp is not None and st.infer_layout is not None
    canonical = broadcast_canonical(trainer_step(st, rank) if rank in TRAINER else None)
    bp = bucket(
        plan_transfers(st.fsdp, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER),
        BUCKET_BYTES,
        version=version,
    )
    src = sources(st, rank)
    full = send_and_receive(
        bp,
        src_tensors=src,
        dst_tensors=lives["full"],
        group=groups["full"],
        wire_dtype=torch.bfloat16,
    )
    rec.report(f"{key}.full", full)
    report = send_and_receive(
        bp,
        src_tensors=src,
        dst_tensors=lives["delta"],
        group=groups["delta"],
        wire_dtype=torch.bfloat16,
        delta=state,
    )
    rec.report(key, report)
    if rank in INFER:
        want = _bf16_live(st, rank, canonical)
        for name, t in lives["delta"].items():
            rec.check(
                same(t, lives["full"][name]), "delta.equals_full", version=version, tensor=name
            )
            rec.check(same(t, want[name]), "delta.equals_trained", version=version, tensor=name)


def section_delta(rec: Recorder, st: State) -> None:
    """Delta syncs after real AdamW steps (fp32 trainer, bf16 on the wire and in the
    destinations) against full syncs of the same versions; a version mismatch; a
    tampered delta."""
    rank = rec.rank
    assert st.optimizer is not None or rank not in TRAINER
    if st.optimizer is not None:
        for g in st.optimizer.param_groups:
            g["lr"] = DELTA_LR
    groups = {
        w: SyncGroup.from_world(
            range(WORLD), timeout_s=TIMEOUT_S, connect_timeout_s=60, name=f"delta_{w}"
        )
        for w in ("full", "delta")
    }
    start = _bf16_live(st, rank, st.canonical)
    lives = {"full": start, "delta": {n: t.clone() for n, t in start.items()}}
    state = DeltaState()
    for i in range(DELTA_STEPS):  # v11 is full (no version held), then deltas
        _delta_round(rec, st, groups, lives, state, 11 + i, f"delta.v{11 + i}")
    rec.measured["delta.kept_bytes"] = state.kept_bytes
    # a mismatch: rank 2 claims a version no source kept; its messages go dense
    if rank == 2:
        state.holds = 999
    _delta_round(rec, st, groups, lives, state, 14, "delta.mismatch")
    # a tampered delta: refused like a tampered full message, nothing changes
    held = {n: t.clone() for n, t in lives["delta"].items()}
    assert st.fsdp is not None and st.infer_layout is not None
    if rank in TRAINER:
        st.optimizer.step()  # type: ignore[union-attr]
    bp = bucket(
        plan_transfers(st.fsdp, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER),
        BUCKET_BYTES,
        version=15,
    )
    if rank == 0:
        groups["delta"]._pg = Tamper(groups["delta"].pg)
    try:
        send_and_receive(
            bp,
            src_tensors=sources(st, rank),
            dst_tensors=lives["delta"],
            group=groups["delta"],
            wire_dtype=torch.bfloat16,
            delta=state,
        )
        rec.fail("delta.tampered.raised", what="the tampered delta sync returned")
    except SyncError as e:
        rec.error("delta.tampered", e, 0.0)
    for name, t in lives["delta"].items():
        rec.check(same(t, held[name]), "delta.tampered_unchanged", tensor=name)
    rec.measured["delta.holds_after_tamper"] = state.holds
    groups["delta"] = groups["delta"].renew()
    _delta_round(rec, st, groups, lives, state, 16, "delta.after_tamper")
    for g in groups.values():
        g.abort()


def section_colocated(rec: Recorder, st: State) -> None:
    rank, meshes = rec.rank, st.meshes
    s = spec()
    fsdp = fsdp2_layout(s, ParallelDims(dp=2, tp=2))
    infer = inference_layout(s, ParallelDims(tp=2), vocab_multiple=1)
    dm = meshes["d2t2"]
    trainer = apply_fsdp2(build_model(s, seed=3), fsdp, dm)
    model = None
    if rank in (0, 1):
        model = tp_engine.apply_tp(build_model(s, seed=4), infer, meshes["tp01"])
    opt = torch.optim.AdamW(trainer.parameters(), lr=LR)
    ids = train_ids()
    d = dm.get_local_rank("dp_shard")
    half = ids[d * BATCH // 2 : (d + 1) * BATCH // 2]
    lm_loss(trainer(input_ids=half).logits, half).backward()
    opt.step()
    canonical = export_canonical(trainer, fsdp)
    plan = plan_transfers(fsdp, infer, src_ranks=range(WORLD), dst_ranks=(0, 1))
    bp = bucket(plan, BUCKET_BYTES, version=1)
    rec.measured["colocated.plan"] = {
        "lower_bound": transfer_lower_bound(fsdp, infer, src_ranks=range(WORLD), dst_ranks=(0, 1)),
        "bytes_total": plan.bytes_total,
        "recv_bytes": {str(k): v for k, v in plan.recv_bytes().items()},
        "local_bytes": {
            str(g): sum(t.nbytes for t in plan.transfers if t.is_local and t.dst == g)
            for g in (0, 1)
        },
        "shard_bytes": {str(g): shard_bytes(infer, g) for g in (0, 1)},
    }
    group = SyncGroup.from_world(range(WORLD), timeout_s=TIMEOUT_S, connect_timeout_s=60)
    live = tp_engine.local_tensors(model) if model is not None else {}
    report = send_and_receive(
        bp, src_tensors=tp_engine.local_tensors(trainer), dst_tensors=live, group=group
    )
    rec.report("colocated", report)
    if model is not None:
        check_live(rec, "colocated.weights", live, infer, rank, canonical)
        check_logits(rec, "colocated", model, reference_logits(s, canonical))
    group.abort()


def tcp_store(rank: int) -> dist.Store:
    """A fresh ``TCPStore`` hosted by rank 0 on a free port, reached by every rank."""
    box: list[Any] = [None]
    store = None
    if rank == 0:
        store = open_store("127.0.0.1", 0, is_master=True)
        box = [store.port]
    dist.broadcast_object_list(box, src=0)
    if store is None:
        store = open_store("127.0.0.1", int(box[0]), is_master=False)
    return store


WRONG_SECRET = b"not the launch's secret, 32 bytes"
FORGED_KEY = b"\x00" * 32  # a session key the group does not have


def section_auth(rec: Recorder, st: State) -> None:
    rank = rec.rank
    s = spec()
    assert st.infer_layout is not None
    secret = os.environ.get(SECRET_ENV, "")
    rec.measured["auth.secret"] = {"length": len(secret), "sha256": sha256_hex(secret)}
    rec.check(len(secret) == 64, "auth.launcher_secret", length=len(secret))
    store = tcp_store(rank)
    # rendezvous: rank 3 holds another secret; every rank refuses, nobody posts a bucket
    dist.barrier()
    try:
        SyncGroup.from_store(
            store,
            members=range(WORLD),
            rank=rank,
            timeout_s=TIMEOUT_S,
            name="auth",
            secret=WRONG_SECRET if rank == 3 else None,
        )
        rec.fail("auth.rendezvous.raised", what="a group with a stray member formed")
    except SyncError as e:
        rec.error("auth.rendezvous", e, 0.0)
    # the next generation, every member with the launch's secret
    group = SyncGroup.from_store(
        store, members=range(WORLD), rank=rank, timeout_s=TIMEOUT_S, name="auth", generation=1
    )
    previous = st.canonical
    v3 = {n: t - 0.01 for n, t in previous.items()}  # the next version, whole on 0 and 1
    replicas = inference_layout(s, ParallelDims(dp=2), vocab_multiple=1)
    bp = bucket(
        plan_transfers(replicas, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER),
        BUCKET_BYTES,
        version=3,
    )
    dst = destinations(st, rank)
    # rank 1 forges: the group's format and plan, other values, a MAC under another key
    forged = {n: t + 1.0 for n, t in v3.items()}
    if rank == 1:
        group._session = FORGED_KEY
    src = (forged if rank == 1 else v3) if rank in TRAINER else {}
    dist.barrier()
    try:
        send_and_receive(bp, src_tensors=src, dst_tensors=dst, group=group)
        rec.fail("auth.forged.raised", what="the sync with a forged sender returned")
    except SyncError as e:
        rec.error("auth.forged", e, 0.0)
    if rank in INFER:
        assert st.infer is not None
        check_live(rec, "auth.unchanged", dst, st.infer_layout, rank - 2, previous)
    group = group.renew()  # the session key of the new generation: rank 1 is honest again
    report = send_and_receive(
        bp, src_tensors=v3 if rank in TRAINER else {}, dst_tensors=dst, group=group
    )
    rec.report("auth.retry", report)
    st.canonical = v3
    if rank in INFER:
        assert st.infer is not None
        check_live(rec, "auth.retry_weights", dst, st.infer_layout, rank - 2, v3)
        check_logits(rec, "auth.retry", st.infer, reference_logits(s, v3))
    group.abort()


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def section_death(rec: Recorder, st: State, out: Path) -> None:
    rank = rec.rank
    s = spec()
    assert st.infer_layout is not None
    store = tcp_store(rank)
    group = SyncGroup.from_store(
        store, members=range(WORLD), rank=rank, timeout_s=TIMEOUT_S, name="death"
    )
    previous = st.canonical
    v4 = {n: t + 0.01 for n, t in previous.items()}  # the next version, whole on 0 and 1
    replicas = inference_layout(s, ParallelDims(dp=2), vocab_multiple=1)
    bp = bucket(
        plan_transfers(replicas, st.infer_layout, src_ranks=TRAINER, dst_ranks=INFER),
        BUCKET_BYTES,
        version=4,
    )
    k = first_bucket_from(bp, 1)
    rec.measured["death.bucket"] = k
    rec.measured["death.tensors"] = expected_failure(bp, k, 1)
    src = v4 if rank in TRAINER else {}
    dst = destinations(st, rank)
    if rank == 1:
        rec.measured["death.exited"] = True
        rec.dump(out, WORLD)

    def die(b: int) -> None:
        if rank == 1 and b == k:
            sys.stdout.flush()
            os._exit(0)

    dist.barrier()
    start = time.monotonic()
    try:
        send_and_receive(bp, src_tensors=src, dst_tensors=dst, group=group, on_bucket=die)
        rec.fail("death.raised", what="the sync whose sender died returned")
    except SyncError as e:
        rec.error("death", e, time.monotonic() - start)
    if rank in INFER:
        assert st.infer is not None
        check_live(rec, "death.unchanged", dst, st.infer_layout, rank - 2, previous)
    # the survivors: a new generation without rank 1, re-planned from rank 0 alone
    survivors = (0, *INFER)
    group = group.renew(members=survivors)
    whole = inference_layout(s, ParallelDims(), vocab_multiple=1)
    bp = bucket(
        plan_transfers(whole, st.infer_layout, src_ranks=(0,), dst_ranks=INFER),
        BUCKET_BYTES,
        version=4,
    )
    report = send_and_receive(bp, src_tensors=src, dst_tensors=dst, group=group)
    rec.report("death.retry", report)
    if rank in INFER:
        assert st.infer is not None
        check_live(rec, "death.retry_weights", dst, st.infer_layout, rank - 2, v4)
        check_logits(rec, "death.retry", st.infer, reference_logits(s, v4))
    rec.measured["death.generation"] = group.generation


# ---------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = Recorder(rank)
    try:
        if world != WORLD:
            rec.fail("setup", what=f"expected {WORLD} ranks, got {world}")
            return 1
        start = time.monotonic()
        # every rank creates every mesh (new_group is collective over the world)
        meshes = {
            "d2": DeviceMesh("cpu", list(TRAINER), mesh_dim_names=("dp_shard",)),
            "tp23": DeviceMesh("cpu", list(INFER), mesh_dim_names=("tp",)),
            "tp01": DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",)),
            "d2t2": init_mesh(fsdp2_layout(spec(), ParallelDims(dp=2, tp=2)).meshes[0]),
        }
        rec.timings["meshes"] = round(time.monotonic() - start, 3)
        st = State(meshes)
        guarded(rec, "split", lambda: section_split(rec, st))
        guarded(rec, "stall", lambda: section_stall(rec, st))
        guarded(rec, "delta", lambda: section_delta(rec, st))
        guarded(rec, "colocated", lambda: section_colocated(rec, st))
        guarded(rec, "auth", lambda: section_auth(rec, st))
        guarded(rec, "death", lambda: section_death(rec, st, out))
        rec.timings["total"] = round(time.monotonic() - start, 3)
    finally:
        rec.dump(out, world, torch=torch.__version__)
        dist.destroy_process_group()
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
