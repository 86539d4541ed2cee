"""Demo worker (run under torchrun by :mod:`areal_fn.runtime.demo.driver`, 4 processes).

Stages (each recorded in the final verification table printed by rank 0):

1. plan: the layouts of ``fsdp:d2t2``, ``megatron:t2p2`` and an inference ``sglang:d1t2``
   (pure; bad input would fail here, before any process group exists);
2. train: a tiny Qwen2-architecture model (random weights from :data:`DEMO_CONFIG`)
   under FSDP2 + TP ``d2t2`` for N steps on a synthetic next-token task;
2b. packed sequences under Ulysses SP: from the trainer's weights, a few steps under
   ``fsdp:d2c2`` on mixed-length sequences packed into rows
   (:mod:`~areal_fn.runtime.demo.packed_phase`; the first step against plain
   transformers run on each sequence alone, tokens per rank counted);
3. checkpoint: canonical tensors written as an HF safetensors checkpoint (rank 0,
   atomic);
4. resume under ``megatron:t2p2``: a Megatron-Core GPTModel loaded from the checkpoint
   through the conversion layer; its canonical weights must equal the trainer's
   bitwise, and its logits must equal the HF reference model's;
5. weight sync to an inference group (TP2, ranks 2-3) by a planned shard-to-shard
   transfer; the inference shards must equal the trainer's weights and hold exactly
   their shard's bytes;
6. packed sequences under context parallelism: the phase of 2b again under
   ``megatron:d2c2``, from the same weights (the same checks, and the same losses).
"""

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.plans.transfer.bound import transfer_lower_bound
from areal_fn.runtime.demo.packed_phase import stage_packed_cp, stage_packed_sp
from areal_fn.runtime.engines.common import AdamWConfig, LRSchedule
from areal_fn.runtime.engines.protocol import Engine
from areal_fn.sharding.shard import bitwise_equal
from areal_fn.strategy.parse import parse_allocation

RESULTS: list[tuple[str, bool, str]] = []

#: AdamW with a short warm-up; the schedule's position travels with the checkpoint.
OPTIMIZER = AdamWConfig(lr=3e-3, schedule=LRSchedule(warmup_steps=3))
FAULT: dict[str, Any] = {}
#: the driver's vLLM server (``url``, ``model``); empty: no vLLM stage
VLLM: dict[str, str] = {}


def stage_rollout(engine: Engine, version: int, what: str) -> None:
    """Update the real vLLM server from ``engine`` and compare its generation (when given)."""
    if VLLM:
        from areal_fn.runtime.demo.vllm_stage import stage_vllm

        stage_vllm(engine, VLLM["url"], VLLM["model"], version, what, record)


def _parse_fault(text: str) -> dict[str, Any]:
    if not text:
        return {}
    rank, _, stage = text.partition(":")
    return {"rank": int(rank), "stage": stage}


def fault(stage: str) -> None:
    """Fault injection for the reliability test: the chosen rank dies at ``stage``."""
    if FAULT and FAULT["stage"] == stage and dist.get_rank() == FAULT["rank"]:
        print(f"rank {FAULT['rank']}: injected death at {stage}", file=sys.stderr, flush=True)
        os._exit(17)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def log(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def record(what: str, ok: bool, figure: str) -> None:
    RESULTS.append((what, bool(ok), figure))
    log(f"[{'ok' if ok else 'FAIL'}] {what}: {figure}")


def batches(vocab: int, steps: int, batch: int = 8, seq: int = 16) -> list[torch.Tensor]:
    """Sequences of an affine recurrence t' = (5 t + 3) mod V from random starts: learnable."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = [start]
        for _ in range(seq - 1):
            seqs.append((seqs[-1] * 5 + 3) % vocab)
        out.append(torch.cat(seqs, dim=1))
    return out


def hf_model(spec_cfg: dict[str, Any]) -> torch.nn.Module:
    import transformers

    cfg = dict(spec_cfg)
    mt = cfg.pop("model_type")
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    config = transformers.AutoConfig.for_model(mt, **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def stage_plan(spec: Any) -> dict[str, Any]:
    layouts = {}
    for alloc in ("fsdp:d2t2", "megatron:t2p2", "sglang:d1t2"):
        a = parse_allocation(alloc)
        comp = a.components[0]
        layout = layout_for(spec, comp)
        layouts[alloc] = layout
        if _rank() == 0:
            per_rank = [
                sum(t.numel for t in layout.local_tensors(r)) for r in range(layout.world_size)
            ]
            log(
                f"plan {alloc}: meshes {', '.join(str(m) for m in layout.meshes)}; elements per rank {per_rank}"
            )
    record("plan", True, f"{len(layouts)} layouts of {spec.num_params:,} parameters")
    return layouts


def stage_train(spec: Any, steps: int) -> tuple[Engine, dict[str, torch.Tensor]]:
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine

    comp = parse_allocation("fsdp:d2t2").components[0]
    engine = Fsdp2Engine(spec, comp, optimizer=OPTIMIZER, grad_clip=1.0, seed=0)
    losses = []
    for i, ids in enumerate(batches(spec.vocab_size, steps)):
        if i == steps // 2:
            fault("train")
        metrics = engine.train_step(ids)
        losses.append(float(metrics["loss"]))
        log(
            f"train step {len(losses)}: loss {losses[-1]:.4f} grad-norm {float(metrics['grad_norm']):.3f}"
        )
    canonical = engine.export_canonical()
    record(
        "train fsdp:d2t2",
        losses[-1] < 0.8 * losses[0],
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps",
    )
    return engine, canonical


def stage_checkpoint(spec: Any, trainer: Engine, steps: int, workdir: Path) -> Path:
    from areal_fn.runtime.checkpoint.api import HfFiles, RankState, save_checkpoint

    rank = dist.get_rank()
    root = workdir / "checkpoints"
    state = RankState(params=trainer.local_state(), optim=trainer.optimizer_local_state())
    path = save_checkpoint(
        root,
        layout=trainer.layout,
        states={rank: state},
        model=spec,
        allocation="fsdp:d2t2",
        step=steps,
        optimizer="adamw",
        data_position={"batches_seen": steps},
        lr_scheduler=trainer.scheduler_state(),
        hf=HfFiles.of_config(DEMO_CONFIG),  # the HF export gets this config.json back
    )
    files = sorted(p.name for p in Path(str(path)).iterdir())
    record(
        "checkpoint (canonical, DCP)",
        (root / "latest").exists(),
        f"step {steps}: params + Adam moments, {len(files)} files, atomic commit -> {Path(str(path)).name}",
    )
    stage_export_hf(spec, trainer, root, workdir)
    return root


def stage_export_hf(spec: Any, trainer: Engine, root: Path, workdir: Path) -> None:
    """The checkpoint as an HF checkpoint that transformers loads, with the trainer's outputs."""
    import transformers

    from areal_fn.runtime.checkpoint.api import export_hf

    ids = batches(spec.vocab_size, 1, batch=2)[0]
    want = trainer.forward_logprobs(ids)  # collective
    diff = 0.0
    if dist.get_rank() == 0:
        out = export_hf(root, workdir / "hf", overwrite=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager"
        )
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        got = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        diff = float((got - want).abs().max())
    box: list[Any] = [diff]
    dist.broadcast_object_list(box, src=0)
    record(
        "export HF checkpoint",
        box[0] < 1e-5,
        f"transformers from_pretrained: log-probs = trainer's within {box[0]:.1e}",
    )


def inference_engine(spec: Any) -> tuple[Any, Any, Any]:
    """The inference side: a DTensor-TP2 transformers model on ranks 2-3 (stale weights)."""
    from torch.distributed.device_mesh import DeviceMesh

    from areal_fn.layouts.inference import inference_layout
    from areal_fn.runtime.engines import tp as tp_engine
    from areal_fn.runtime.engines.fsdp2 import build_hf_model
    from areal_fn.runtime.sync.executor import SyncGroup

    comp = parse_allocation("sglang:d1t2").components[0]
    infer = inference_layout(spec, comp.dims, vocab_multiple=1)  # DTensor TP: no vocab padding
    tp_mesh = DeviceMesh("cpu", [2, 3], mesh_dim_names=("tp",))
    model = None
    if dist.get_rank() >= 2:
        model = tp_engine.apply_tp(build_hf_model(spec, seed=99), infer, tp_mesh)
    group = SyncGroup.from_world([0, 1, 2, 3], timeout_s=60)
    return infer, model, group


def stage_sync(spec: Any, source: Engine, target: Any, version: int, what: str) -> None:
    """Planned shard-to-shard sync from a training engine (ranks 0-3) to the TP2 model."""
    from areal_fn.runtime.engines import tp as tp_engine
    from areal_fn.runtime.sync.executor import send_and_receive

    infer, model, group = target
    plan = plan_transfers(source.layout, infer, src_ranks=range(4), dst_ranks=(2, 3))
    # the least bytes any plan must move, from the two layouts alone (not from the plan)
    bound = transfer_lower_bound(source.layout, infer, src_ranks=range(4), dst_ranks=(2, 3))
    buckets = bucket(plan, 64 << 10, version=version)
    live = tp_engine.local_tensors(model) if model is not None else {}
    fault("sync")
    report = send_and_receive(
        buckets, src_tensors=source.local_state(), dst_tensors=live, group=group
    )
    ids = batches(spec.vocab_size, 1, batch=2)[0]
    want = source.forward_logprobs(ids)  # collective over the engine's ranks
    diff = 0.0
    if model is not None:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        got = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        diff = float((got - want).abs().max())
    stats: list[Any] = [None] * 4
    dist.all_gather_object(stats, (diff, report.bytes_received))
    worst = max(d for d, _ in stats)
    recv = [b for _, b in stats[2:]]
    need = [plan.recv_bytes()[g] for g in (2, 3)]
    record(
        f"weight sync {what} -> sglang:d1t2",
        worst < 1e-5 and recv == need and plan.bytes_total == bound,
        f"v{buckets.version}, {len(buckets.buckets)} buckets, {plan.bytes_total} B over the wire "
        f"({'=' if plan.bytes_total == bound else '!='} lower bound {bound} B from the layouts); "
        f"inference logprobs = the engine's within {worst:.1e}",
    )


def _canonical_moments(engine: Engine, moment: str) -> dict[str, torch.Tensor]:
    mine = {name: st[moment] for name, st in engine.optimizer_local_state().items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    from areal_fn.plans.convert import to_hf

    return to_hf(dict(enumerate(gathered)), engine.layout)


def stage_megatron(
    spec: Any,
    root: Path,
    canonical: dict[str, torch.Tensor],
    trainer: Engine,
    target: Any,
    version: int,
) -> None:
    from areal_fn.runtime.checkpoint.api import RankState, load_checkpoint
    from areal_fn.runtime.engines.megatron import MegatronEngine

    rank = dist.get_rank()
    ids = batches(spec.vocab_size, 1, batch=4)[0]
    want = trainer.forward_logprobs(ids)
    trainer_moments = _canonical_moments(trainer, "exp_avg_sq")
    comp = parse_allocation("megatron:t2p2").components[0]
    with MegatronEngine(spec, comp, optimizer=OPTIMIZER, seed=1) as engine:
        state = RankState(
            params=engine.local_state(), optim=engine.optimizer_local_state(create=True)
        )
        result = load_checkpoint(
            root, layout=engine.layout, states={rank: state}, optimizer="adamw"
        )
        engine.load_scheduler_state(result.lr_scheduler or {})
        back = engine.export_canonical()
        same = back.keys() == canonical.keys() and all(
            bitwise_equal(back[k], canonical[k]) for k in canonical
        )
        moments = _canonical_moments(engine, "exp_avg_sq")
        same_opt = all(bitwise_equal(moments[k], trainer_moments[k]) for k in trainer_moments)
        record(
            "resume megatron:t2p2",
            same and same_opt and result.step is not None and engine.steps_done == result.step,
            f"step {result.step}, data {result.data_position}, LR schedule at step {engine.steps_done}: "
            f"{len(back)} weights and their Adam moments bitwise equal",
        )
        got = engine.forward_logprobs(ids)
        diff = float((got - want).abs().max())
        record(
            "megatron logprobs vs trainer",
            diff < 1e-5,
            f"max |diff| {diff:.1e} (fp32, pipeline forward)",
        )
        before = float(engine.train_step(ids)["loss"])
        after = float(engine.train_step(ids)["loss"])
        record(
            "train megatron:t2p2",
            after < before,
            f"loss {before:.3f} -> {after:.3f} continuing from the checkpoint",
        )
        stage_sync(spec, engine, target, version + 2, "megatron:t2p2")
        stage_rollout(engine, version + 2, "megatron:t2p2")


def main() -> None:
    from areal_fn.errors import SpecError
    from areal_fn.runtime.demo.driver import STEPS, check_demo_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--workdir", required=True, help="a new or empty directory")
    parser.add_argument(
        "--fault", default="", help="RANK:STAGE: that rank dies there (train, sync)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="collective timeout in seconds"
    )
    parser.add_argument(
        "--vllm-url", default="", help="a vLLM server with the areal_fn backend (http://...)"
    )
    parser.add_argument("--vllm-model", default="", help="the model name that server serves")
    args = parser.parse_args()
    try:  # before any process group, and before any rank writes into the workdir
        check_demo_flags(steps=args.steps, workdir=args.workdir)
    except SpecError as e:
        print(f"areal-fn demo worker: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    FAULT.update(_parse_fault(args.fault))
    if args.vllm_url:
        VLLM.update(url=args.vllm_url, model=args.vllm_model)
    spec = model_from_hf_config(DEMO_CONFIG)
    workdir = Path(args.workdir)
    backend = os.environ.get("AREAL_FN_BACKEND", "gloo")
    start = time.perf_counter()
    stage_plan(spec)  # pure: before any process group
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=args.timeout))
    complete = False
    try:
        trainer, canonical = stage_train(spec, args.steps)
        packed = stage_packed_sp(spec, canonical, OPTIMIZER, record, log)
        root = stage_checkpoint(spec, trainer, args.steps, workdir)
        target = inference_engine(spec)
        stage_sync(spec, trainer, target, args.steps, "fsdp:d2t2")
        stage_rollout(trainer, args.steps, "fsdp:d2t2")
        stage_megatron(spec, root, canonical, trainer, target, args.steps)
        stage_packed_cp(spec, canonical, packed, OPTIMIZER, record, log)
        complete = True
    finally:
        if dist.get_rank() == 0:
            _summary(time.perf_counter() - start, complete=complete)
        dist.destroy_process_group()
    if not all(ok for _, ok, _ in RESULTS):
        raise SystemExit(1)


def summary_title(results: list[tuple[str, bool, str]], *, complete: bool, seconds: float) -> str:
    """The table's title: "verified" only when every stage ran and every check passed."""
    failed = [what for what, ok, _ in results if not ok]
    if failed:
        verdict = f"FAILED {len(failed)} of {len(results)} checks ({', '.join(failed)})"
    else:
        verdict = "verified"
    if not complete:
        stopped = (
            f"stopped after {results[-1][0]!r}" if results else "stopped before the first check"
        )
        verdict = (
            f"{verdict}, {stopped}" if failed else f"NOT verified, {stopped}"
        ) + " (see the error report)"
    return f"areal_fn demo: {verdict} on CPU/gloo, 4 ranks, {seconds:.1f} s"


def _summary(seconds: float, *, complete: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from areal_fn.runtime.console import text_console

    table = Table(title=summary_title(RESULTS, complete=complete, seconds=seconds))
    table.add_column("check")
    table.add_column("result")
    table.add_column("figures")
    for what, ok, figure in RESULTS:
        table.add_row(what, Text("ok", style="green") if ok else Text("FAIL", style="red"), figure)
    text_console(width=140).print(table)


if __name__ == "__main__":
    main()
