"""torchrun worker: LoRA training in the FSDP2 engine against ``peft`` on one process.

Launched once by ``tests/distributed/test_lora_training.py`` with 4 ranks (gloo, CPU).
For every case (model, strategy) every rank:

1. builds the reference: the transformers model of the tiny config, its canonical
   tensors ``w0``, wrapped by ``peft.get_peft_model`` with adapters set to seeded random
   values (``lora_B`` not zero, so both adapters get gradients); ``STEPS`` steps on the
   whole global batch (mean next-token cross entropy, ``clip_grad_norm_`` over the
   adapters, ``torch.optim.AdamW`` over the adapters): loss, grad norm and clipped
   adapter gradients of every step, the adapters after the steps, the log-probs after;
2. builds ``Fsdp2Engine(..., lora=config)``, loads ``w0`` (base only) and the adapters,
   checks both export back bitwise;
3. runs the same steps on its data-parallel share and measures the differences; records
   whether any base parameter holds a gradient, what the optimizer holds, and whether
   the base weights moved.

Then (``checkpoint`` section) the adapters and their AdamW state are saved with
``save_checkpoint`` under one strategy and loaded under another.

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.layouts.fsdp2 import Fsdp2Options  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.lora import EXPERT_PARAMETERS, LoraConfig, lora_tensors  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.convert import to_hf  # noqa: E402
from areal_fn.runtime.checkpoint import RankState, load_checkpoint, save_checkpoint  # noqa: E402
from areal_fn.runtime.checkpoint.lora import lora_hf_files  # noqa: E402
from areal_fn.runtime.engines.common import AdamWConfig, split_rows  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine, build_hf_model  # noqa: E402
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint  # noqa: E402
from areal_fn.strategy.parse import parse_allocation  # noqa: E402

WORLD = 4
BATCH, SEQ = 8, 16
STEPS = 2
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 0.5

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 50,
        "torch_dtype": "float32",
    },
    "qwen2_4l": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 50,
        "torch_dtype": "float32",
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 52,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "torch_dtype": "float32",
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 16,
        "intermediate_size": 24,
        "moe_intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "torch_dtype": "float32",
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "vocab_size": 61,
        "torch_dtype": "float32",
    },
}
#: Every module, with a different rank for the MLP's down projection.
LORA = LoraConfig(rank=4, alpha=8.0, module_ranks=(("down_proj", 2),))
#: A MoE family's: the attention projections (PEFT would adapt the fused experts).
LORA_MOE = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


#: Routed experts too: both fused expert parameters (PEFT's ``target_parameters``).
LORA_EXPERTS = LoraConfig(
    rank=4,
    alpha=8.0,
    target_modules=("q_proj", "k_proj", "v_proj"),
    target_parameters=EXPERT_PARAMETERS,
)


def lora_of(spec: ModelSpec) -> LoraConfig:
    """The configuration the cases train ``spec`` with."""
    if spec.model_type == "qwen3_moe":
        return LORA_EXPERTS
    return LORA_MOE if spec.family.moe else LORA


#: (config, strategy, HSDP replicas)
CASES: tuple[tuple[str, str, int], ...] = (
    ("qwen2", "fsdp:d4", 1),
    ("qwen2", "fsdp:d2t2", 1),
    ("qwen2", "fsdp:d2c2", 1),
    ("qwen2", "fsdp:d4", 2),
    ("mixtral", "fsdp:d2t2", 1),
    ("qwen3", "fsdp:d2t2", 1),
    ("qwen3", "fsdp:t2c2", 1),
    ("qwen3_moe", "fsdp:d4", 1),
    ("qwen3_moe", "fsdp:d2t2", 1),
    ("qwen3_moe", "fsdp:d4", 2),
)


#: Parameters whose DTensor placements the cases record.
PLACED = tuple(
    f"model.layers.0.{m}{a}weight"
    for m in ("self_attn.q_proj", "self_attn.o_proj")
    for a in (".", ".lora_A.", ".lora_B.")
) + tuple(
    f"model.layers.0.mlp.experts.{p}{a}"
    for p in ("gate_up_proj", "down_proj")
    for a in ("", "_lora_A", "_lora_B")
)


def case_id(config: str, strategy: str, replicas: int) -> str:
    return f"{config}/{strategy}" + (f"+r{replicas}" if replicas > 1 else "")


def peft_name(name: str) -> str:
    """PEFT's live parameter name of adapter tensor ``name`` (its ``default`` adapter)."""
    return name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )


def adapters_of(spec: ModelSpec, seed: int = 7) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        s.name: torch.randn(s.shape, generator=g) * 0.2 for s in lora_tensors(spec, lora_of(spec))
    }


def batch(spec: ModelSpec) -> Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)


def peft_model(spec: ModelSpec, adapters: dict[str, Tensor]) -> torch.nn.Module:
    import peft

    lora = lora_of(spec)
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        rank_pattern=dict(lora.module_ranks),
        target_parameters=list(lora.target_parameters) or None,
    )
    model = peft.get_peft_model(build_hf_model(spec), config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in adapters.items():
            params[peft_name(name)].copy_(t)
    return model


def mean_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def reference(config: str) -> dict[str, Any]:
    spec = model_from_hf_config(CONFIGS[config])
    base = build_hf_model(spec)
    w0 = hf_state_to_canonical(base.state_dict(), spec)
    adapters = adapters_of(spec)
    model = peft_model(spec, adapters)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = {peft_name(n): n for n in adapters}
    if set(trained) != set(names):
        raise AssertionError(f"peft trains {sorted(trained)[:4]}..., not the adapters")
    opt = torch.optim.AdamW(
        list(trained.values()),
        lr=ADAMW.lr,
        betas=ADAMW.betas,
        eps=ADAMW.eps,
        weight_decay=ADAMW.weight_decay,
    )
    ids = batch(spec)
    steps = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = mean_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(trained.values()), CLIP)
        grads = {names[n]: p.grad.detach().clone() for n, p in trained.items()}
        steps.append({"loss": float(loss.detach()), "grad_norm": float(norm), "grads": grads})
        opt.step()
    with torch.no_grad():
        logp = logprobs(model(input_ids=ids).logits, ids)
    after = {names[n]: p.detach().clone() for n, p in trained.items()}
    return dict(spec=spec, w0=w0, adapters=adapters, ids=ids, steps=steps, after=after, logp=logp)


def max_abs(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"names differ: {sorted(set(a) ^ set(b))[:4]}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def bitwise(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def gathered_grads(engine: Fsdp2Engine) -> dict[str, Tensor]:
    """The engine's clipped adapter gradients as canonical (PEFT-named) tensors."""
    layout = engine.adapter_layout
    assert layout is not None
    grads = engine.local_grads()
    mine = {lt.name: grads[lt.name] for lt in layout.local_tensors(engine.rank)}
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, {k: None if v is None else v.cpu() for k, v in mine.items()})
    return to_hf(dict(enumerate(every)), layout)


def engine_of(spec: ModelSpec, strategy: str, replicas: int) -> Fsdp2Engine:
    return Fsdp2Engine(
        spec,
        parse_allocation(strategy).training,
        options=Fsdp2Options(hsdp_replicas=replicas),
        optimizer=ADAMW,
        grad_clip=CLIP,
        lora=lora_of(spec),
    )


def run_case(ref: dict[str, Any], strategy: str, replicas: int) -> dict[str, Any]:
    spec = ref["spec"]
    engine = engine_of(spec, strategy, replicas)
    engine.load_canonical(ref["w0"])
    engine.load_adapters(ref["adapters"])
    out: dict[str, Any] = {}
    exported = engine.export_canonical()
    base_names = [c.name for c in engine.base_layout.canonical]
    out["load_export_bitwise"] = bitwise(engine.export_adapters(), ref["adapters"]) and bitwise(
        {k: exported[k] for k in base_names}, ref["w0"]
    )
    rows = split_rows(ref["ids"], engine.dp_size, engine.dp_rank)
    diffs = []
    for want in ref["steps"]:
        stats = engine.train_step(rows)
        diffs.append(
            dict(
                loss_abs_diff=abs(stats["loss"] - want["loss"]),
                grad_norm_rel_diff=abs(stats["grad_norm"] - want["grad_norm"]) / want["grad_norm"],
                grad_max_abs_diff=max_abs(gathered_grads(engine), want["grads"]),
                grad_max_abs=max(float(g.abs().max()) for g in want["grads"].values()),
                clip_coef=stats["clip_coef"],
            )
        )
    out["steps"] = diffs
    out["adapter_max_abs_diff"] = max_abs(engine.export_adapters(), ref["after"])
    out["adapter_moved"] = max_abs(ref["after"], ref["adapters"])
    after = engine.export_canonical()
    out["base_unchanged"] = bitwise({k: after[k] for k in base_names}, ref["w0"])
    rows_logp = engine.forward_logprobs(rows)
    want_logp = split_rows(ref["logp"], engine.dp_size, engine.dp_rank)
    out["logprob_max_abs_diff"] = float((rows_logp - want_logp).abs().max())
    frozen = [n for n, p in engine.model.named_parameters() if n not in engine._params]
    out["frozen"] = len(frozen)
    out["frozen_with_grad"] = [
        n for n, p in engine.model.named_parameters() if n in frozen and p.grad is not None
    ]
    out["frozen_requiring_grad"] = [
        n for n, p in engine.model.named_parameters() if n in frozen and p.requires_grad
    ]
    held = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    named = {id(p): n for n, p in engine.model.named_parameters()}
    adapters = sorted(t.name for t in engine.adapter_layout.tensors)  # type: ignore[union-attr]
    out["adapters"] = len(adapters)
    out["optimizer_params_are_adapters"] = sorted(named[i] for i in held) == adapters
    out["optimizer_state_is_adapters"] = (
        sorted(named[id(p)] for p in engine.optimizer.state) == adapters
    )
    params = dict(engine.model.named_parameters())
    out["placements"] = {
        n: str(tuple(params[n].placements))  # type: ignore[attr-defined]
        for n in PLACED
        if n in params
    }
    return out


#: The checkpoint section: saved under the first strategy, loaded under the second.
CHECKPOINT = ("qwen2", "fsdp:d2t2", "fsdp:d4")


def gathered_optimizer(engine: Fsdp2Engine) -> dict[str, Tensor]:
    """The engine's AdamW moments as canonical tensors (``<adapter>/<state>``)."""
    layout = engine.adapter_layout
    assert layout is not None
    opt = engine.optimizer_local_state()
    out: dict[str, Tensor] = {}
    for state in ("exp_avg", "exp_avg_sq"):
        mine = {n: s[state].cpu() for n, s in opt.items()}
        every: list[Any] = [None] * WORLD
        dist.all_gather_object(every, mine)
        out |= {f"{k}/{state}": v for k, v in to_hf(dict(enumerate(every)), layout).items()}
    out["steps"] = torch.tensor(sorted({float(s["step"]) for s in opt.values()}))
    return out


def run_checkpoint(ref: dict[str, Any], root: Path) -> dict[str, Any]:
    """One step under ``fsdp:d2t2``, adapters and AdamW state saved; a fresh ``fsdp:d4``
    engine loads its base from an HF checkpoint (a reader) and the adapters from the
    checkpoint, and takes the second step."""
    spec = ref["spec"]
    _, src, dst = CHECKPOINT
    a = engine_of(spec, src, 1)
    a.load_canonical(ref["w0"])
    a.load_adapters(ref["adapters"])
    a.train_step(split_rows(ref["ids"], a.dp_size, a.dp_rank))
    assert a.adapter_layout is not None
    path = save_checkpoint(
        root,
        layout=a.adapter_layout,
        states={a.rank: RankState(params=a.adapter_local_state(), optim=a.optimizer_local_state())},
        model=spec,
        allocation=src,
        step=1,
        optimizer="adamw",
        lr_scheduler=a.scheduler_state(),
        hf=lora_hf_files(spec, LORA),
    )
    saved, saved_opt = a.export_adapters(), gathered_optimizer(a)
    logp = a.forward_logprobs(ref["ids"])  # every share passes the whole batch
    base_dir = root.parent / "base"
    if a.rank == 0:
        write_hf_checkpoint(base_dir, ref["w0"], model=spec, overwrite=True)
    dist.barrier()
    b = engine_of(spec, dst, 1)
    with HfCheckpoint(base_dir) as ckpt:  # a reader: the base alone; the adapters come
        b.load_canonical(ckpt.read)  # from the checkpoint
    assert b.adapter_layout is not None
    fresh = b.export_adapters()
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
    loaded, loaded_opt = b.export_adapters(), gathered_optimizer(b)
    stats = b.train_step(split_rows(ref["ids"], b.dp_size, b.dp_rank))
    return dict(
        path=str(path),
        logprobs=logp.tolist(),
        fresh_differs=not bitwise(fresh, saved),
        adapters_bitwise=bitwise(loaded, saved),
        optimizer_bitwise=bitwise(loaded_opt, saved_opt),
        steps_done=b.steps_done,
        second_loss_abs_diff=abs(stats["loss"] - ref["steps"][1]["loss"]),
        adapter_max_abs_diff=max_abs(b.export_adapters(), ref["after"]),
    )


def run_checkpoint_section(
    refs: dict[str, dict[str, Any]], out: Path, results: dict[str, Any]
) -> None:
    t0 = time.monotonic()
    try:
        rec = run_checkpoint(refs[CHECKPOINT[0]], out / "checkpoint")
        rec["error"] = None
    except Exception:
        rec = {"error": traceback.format_exc()}
    rec["seconds"] = round(time.monotonic() - t0, 2)
    results["checkpoint"] = rec
    if dist.get_rank() == 0:
        print(f"checkpoint: {rec['error']}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated case ids (default: all)")
    args = parser.parse_args()
    only = [c for c in CASES if case_id(*c) in args.only.split(",")] if args.only else CASES
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    refs: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    try:
        for config, strategy, replicas in only:
            t0 = time.monotonic()
            try:
                if config not in refs:
                    refs[config] = reference(config)
                rec = run_case(refs[config], strategy, replicas)
                rec["error"] = None
            except Exception:
                rec = {"error": traceback.format_exc()}
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, rec["error"])
            rec["rank_errors"] = errors
            rec["seconds"] = round(time.monotonic() - t0, 2)
            results[case_id(config, strategy, replicas)] = rec
            if rank == 0:
                print(f"{case_id(config, strategy, replicas)}: {rec['error']}", flush=True)
        if not args.only:
            run_checkpoint_section(refs, Path(args.out), results)
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
