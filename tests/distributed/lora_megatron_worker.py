"""torchrun worker: LoRA training in the Megatron engine against ``peft`` on one process.

Launched once by ``tests/distributed/test_lora_megatron.py`` with 4 ranks (gloo, CPU).
For every strategy every rank builds the reference of ``lora_worker.py`` (the
transformers model wrapped by ``peft.get_peft_model``, adapters on every projection,
``STEPS`` AdamW steps on the whole batch), then ``MegatronEngine(..., lora=config)`` from
the same base weights and adapters (``linear_qkv`` / ``linear_fc1`` hold the fused
adapters), runs the same steps on its data-parallel share and measures the differences.

Rank 0 writes ``<out>/results.json``. Checks never raise inside a case.
"""

import argparse
import datetime
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.plans.convert import to_hf  # noqa: E402
from areal_fn.runtime.checkpoint import RankState, load_checkpoint, save_checkpoint  # noqa: E402
from areal_fn.runtime.checkpoint.lora import lora_hf_files  # noqa: E402
from areal_fn.runtime.engines.common import split_rows  # noqa: E402
from areal_fn.runtime.engines.megatron import MegatronEngine  # noqa: E402
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint  # noqa: E402
from areal_fn.strategy.parse import parse_allocation  # noqa: E402
from tests.distributed import lora_worker as lw  # noqa: E402

WORLD = 4
CASES: tuple[tuple[str, str], ...] = (
    ("qwen2", "megatron:d2t2"),
    ("qwen2", "megatron:d2p2"),
    ("qwen2", "megatron:t2p2"),
    ("qwen3", "megatron:d2t2"),
    ("qwen2_4l", "megatron:d2p2v2"),
    ("qwen2", "megatron:d2c2"),
    ("mixtral", "megatron:d4e2"),
    ("qwen3_moe", "megatron:d4e2"),
    ("qwen3_moe", "megatron:d2p2e2"),
    ("qwen3_moe", "megatron:d4e4"),
)


def gathered_grads(engine: MegatronEngine) -> dict[str, Tensor]:
    """The engine's clipped adapter gradients as canonical (PEFT-named) tensors."""
    layout = engine.adapter_layout
    assert layout is not None
    grads = engine.local_grads()
    mine = {lt.name: grads[lt.name] for lt in layout.local_tensors(engine.rank)}
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, {k: None if v is None else v.cpu() for k, v in mine.items()})
    return to_hf(dict(enumerate(every)), layout)


def run_case(ref: dict[str, Any], strategy: str) -> dict[str, Any]:
    spec = ref["spec"]
    with MegatronEngine(
        spec,
        parse_allocation(strategy).training,
        optimizer=lw.ADAMW,
        grad_clip=lw.CLIP,
        lora=lw.lora_of(spec),
    ) as engine:
        assert engine.adapter_layout is not None
        out: dict[str, Any] = {}
        fused = [t.name for t in engine.adapter_layout.tensors if ".linear_qkv.lora_" in t.name]
        out["fused_adapters"] = len(fused)
        out["expert_adapters"] = len(
            [t for t in engine.adapter_layout.tensors if ".local_experts." in t.name]
        )
        start = engine.export_adapters()
        out["initial_b_zero"] = all(
            not bool(t.any()) for k, t in start.items() if k.endswith("lora_B.weight")
        )
        engine.load_canonical(ref["w0"])
        engine.load_adapters(ref["adapters"])
        exported = engine.export_canonical()
        base = [c.name for c in engine.base_layout.canonical]
        out["load_export_bitwise"] = lw.bitwise(
            engine.export_adapters(), ref["adapters"]
        ) and lw.bitwise({k: exported[k] for k in base}, ref["w0"])
        rows = split_rows(ref["ids"], engine.dp_size, engine.dp_rank)
        diffs = []
        for want in ref["steps"]:
            stats = engine.train_step(rows)
            diffs.append(
                dict(
                    loss_abs_diff=abs(stats["loss"] - want["loss"]),
                    grad_norm_rel_diff=abs(stats["grad_norm"] - want["grad_norm"])
                    / want["grad_norm"],
                    grad_max_abs_diff=lw.max_abs(gathered_grads(engine), want["grads"]),
                    grad_max_abs=max(float(g.abs().max()) for g in want["grads"].values()),
                )
            )
        out["steps"] = diffs
        out["adapter_max_abs_diff"] = lw.max_abs(engine.export_adapters(), ref["after"])
        after = engine.export_canonical()
        out["base_unchanged"] = lw.bitwise({k: after[k] for k in base}, ref["w0"])
        logp = engine.forward_logprobs(rows)
        want_logp = split_rows(ref["logp"], engine.dp_size, engine.dp_rank)
        out["logprob_max_abs_diff"] = float((logp - want_logp).abs().max())
        grads = engine.local_grads()
        adapters = {lt.name for lt in engine.adapter_layout.local_tensors(engine.rank)}
        out["base_with_grad"] = sorted(
            n for n, g in grads.items() if g is not None and n not in adapters
        )
        out["optimizer_is_adapters"] = sorted(engine.optimizer_local_state()) == sorted(adapters)
        return out


def run_checkpoint(ref: dict[str, Any], root: Path) -> dict[str, Any]:
    """One step of ``megatron:d2t2`` (its base read from an HF checkpoint by a reader), its
    adapters and AdamW state saved; a fresh FSDP2 ``fsdp:d4`` engine loads them and takes
    the second step."""
    spec = ref["spec"]
    with MegatronEngine(
        spec,
        parse_allocation("megatron:d2t2").training,
        optimizer=lw.ADAMW,
        grad_clip=lw.CLIP,
        lora=lw.LORA,
    ) as a:
        assert a.adapter_layout is not None
        base_dir = root.parent / "base"
        if a.rank == 0:
            write_hf_checkpoint(base_dir, ref["w0"], model=spec, overwrite=True)
        dist.barrier()
        with HfCheckpoint(base_dir) as ckpt:  # a reader: the base alone
            a.load_canonical(ckpt.read)
        a.load_adapters(ref["adapters"])
        a.train_step(split_rows(ref["ids"], a.dp_size, a.dp_rank))
        path = save_checkpoint(
            root,
            layout=a.adapter_layout,
            states={
                a.rank: RankState(params=a.adapter_local_state(), optim=a.optimizer_local_state())
            },
            model=spec,
            allocation="megatron:d2t2",
            step=1,
            optimizer="adamw",
            lr_scheduler=a.scheduler_state(),
            hf=lora_hf_files(spec, lw.LORA),
        )
        saved = a.export_adapters()
    b = lw.engine_of(spec, "fsdp:d4", 1)
    b.load_canonical(ref["w0"])
    assert b.adapter_layout is not None
    res = load_checkpoint(
        path,
        layout=b.adapter_layout,
        states={
            b.rank: RankState(
                params=b.adapter_local_state(), optim=b.optimizer_local_state(create=True)
            )
        },
        optimizer="adamw",
    )
    assert res.lr_scheduler is not None
    b.load_scheduler_state(res.lr_scheduler)
    loaded = b.export_adapters()
    stats = b.train_step(split_rows(ref["ids"], b.dp_size, b.dp_rank))
    return dict(
        adapters_bitwise=lw.bitwise(loaded, saved),
        steps_done=b.steps_done,
        second_loss_abs_diff=abs(stats["loss"] - ref["steps"][1]["loss"]),
        adapter_max_abs_diff=lw.max_abs(b.export_adapters(), ref["after"]),
    )


#: The expert-adapter checkpoint: saved under the first strategy after one step; each
#: other strategy loads the checkpoint the one before it saved, saves what it loaded
#: and takes the second step.
EXPERT_CHECKPOINT = ("qwen3_moe", "megatron:d4e2", "megatron:d2p2e2", "fsdp:d4", "megatron:d4e4")


def _save(engine: Any, root: Path, allocation: str, step: int) -> Path:
    path: Path = save_checkpoint(
        root,
        layout=engine.adapter_layout,
        states={
            engine.rank: RankState(
                params=engine.adapter_local_state(), optim=engine.optimizer_local_state()
            )
        },
        model=engine.spec,
        allocation=allocation,
        step=step,
        optimizer="adamw",
        lr_scheduler=engine.scheduler_state(),
        hf=lora_hf_files(engine.spec, lw.lora_of(engine.spec)),
    )
    return path


def _load_into(engine: Any, path: Path) -> None:
    assert engine.adapter_layout is not None
    res = load_checkpoint(
        path,
        layout=engine.adapter_layout,
        states={
            engine.rank: RankState(
                params=engine.adapter_local_state(),
                optim=engine.optimizer_local_state(create=True),
            )
        },
        optimizer="adamw",
    )
    assert res.lr_scheduler is not None
    engine.load_scheduler_state(res.lr_scheduler)


def _engine(spec: Any, strategy: str) -> Any:
    if strategy.startswith("fsdp:"):
        return lw.engine_of(spec, strategy, 1)
    dims = parse_allocation(strategy).training
    return MegatronEngine(spec, dims, optimizer=lw.ADAMW, grad_clip=lw.CLIP, lora=lw.lora_of(spec))


def run_expert_checkpoint(ref: dict[str, Any], root: Path) -> dict[str, Any]:
    """One step of ``megatron:d4e2`` with adapters on the routed experts (each local
    expert's part of PEFT's fused pair, ``lora_B`` columns ``e::E``), its adapters and
    AdamW state saved; a fresh ``megatron:d2p2e2`` engine loads them and saves them
    again, a fresh FSDP2 ``fsdp:d4`` engine loads that and saves it again, a fresh
    ``megatron:d4e4`` engine loads that: each loads bitwise and takes the second step."""
    spec = ref["spec"]
    _, src, *dsts = EXPERT_CHECKPOINT
    with _engine(spec, src) as a:
        a.load_canonical(ref["w0"])
        a.load_adapters(ref["adapters"])
        a.train_step(split_rows(ref["ids"], a.dp_size, a.dp_rank))
        path = _save(a, root / "0", src, 1)
        saved, saved_opt = a.export_adapters(), lw.gathered_optimizer(a)
    out: dict[str, Any] = {"expert_tensors": sum(".experts." in k for k in saved)}
    for i, dst in enumerate(dsts, 1):
        b = _engine(spec, dst)
        try:
            b.load_canonical(ref["w0"])
            _load_into(b, path)
            loaded, loaded_opt = b.export_adapters(), lw.gathered_optimizer(b)
            path = _save(b, root / str(i), dst, 1)
            stats = b.train_step(split_rows(ref["ids"], b.dp_size, b.dp_rank))
            out[dst] = dict(
                adapters_bitwise=lw.bitwise(loaded, saved),
                optimizer_bitwise=lw.bitwise(loaded_opt, saved_opt),
                steps_done=b.steps_done,
                second_loss_abs_diff=abs(stats["loss"] - ref["steps"][1]["loss"]),
                adapter_max_abs_diff=lw.max_abs(b.export_adapters(), ref["after"]),
            )
        finally:
            if hasattr(b, "close"):
                b.close()
    return out


def checkpoint_section(refs: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        rec = run_checkpoint(refs["qwen2"], out / "checkpoint")
        rec["error"] = None
    except Exception:
        rec = {"error": traceback.format_exc()}
    rec["seconds"] = round(time.monotonic() - t0, 2)
    if dist.get_rank() == 0:
        print(f"checkpoint: {rec['error']}", flush=True)
    return rec


def expert_checkpoint_section(refs: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    config = EXPERT_CHECKPOINT[0]
    try:
        if config not in refs:
            refs[config] = lw.reference(config)
        rec = run_expert_checkpoint(refs[config], out / "expert_checkpoint")
        rec["error"] = None
    except Exception:
        rec = {"error": traceback.format_exc()}
    rec["seconds"] = round(time.monotonic() - t0, 2)
    if dist.get_rank() == 0:
        print(f"expert_checkpoint: {rec['error']}", flush=True)
    return rec


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--only", default="", help="comma-separated case ids or expert_checkpoint (default: all)"
    )
    args = parser.parse_args()
    only = [c for c in CASES if "/".join(c) in args.only.split(",")] if args.only else CASES
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    refs: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    try:
        for config, strategy in only:
            t0 = time.monotonic()
            try:
                if config not in refs:
                    refs[config] = lw.reference(config)
                rec = run_case(refs[config], strategy)
                rec["error"] = None
            except Exception:
                rec = {"error": traceback.format_exc()}
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, rec["error"])
            rec["rank_errors"] = errors
            rec["seconds"] = round(time.monotonic() - t0, 2)
            results[f"{config}/{strategy}"] = rec
            if rank == 0:
                print(f"{config}/{strategy}: {rec['error']}", flush=True)
        if not args.only:
            results["checkpoint"] = checkpoint_section(refs, Path(args.out))
        if not args.only or "expert_checkpoint" in args.only.split(","):
            results["expert_checkpoint"] = expert_checkpoint_section(refs, Path(args.out))
    finally:
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            body = {"cases": results, "seconds": round(time.monotonic() - start, 2)}
            (out / "results.json").write_text(json.dumps(body, indent=1, sort_keys=True))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
