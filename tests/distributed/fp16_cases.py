"""fp16 with a dynamic loss scale: several steps of an engine against torch's own AMP.

Run inside ``grad_worker.py``'s launch (4 ranks, gloo). For every fp16 case each rank:

1. runs the reference in one process: the same randomized transformers model
   (fp32 parameters) under ``torch.autocast("cpu", dtype=torch.float16)``, the loss
   through ``torch.amp.GradScaler("cpu")`` (``scale(loss).backward()``, ``unscale_``,
   ``clip_grad_norm_``, ``step``, ``update``), AdamW, for :data:`STEPS` steps of packed
   sequences (each run alone, as in ``reference_packed``); it records each step's loss,
   the scale used, whether the scaler skipped the step (its scale went down), the
   scaler's state after it and the canonical weights after it;
2. runs the engine (``Fsdp2Engine`` with ``fp32_params_fp16_compute``,
   ``MegatronEngine`` with ``fp16_mixed``, the same :data:`LOSS_SCALE`) from the same
   weights on each data-parallel share of the same sequences and records the same.

Two steps overflow on purpose. Step :data:`HUGE_STEP` gives one token of one sequence
(on data-parallel share 0) a weight of :data:`HUGE_WEIGHT`: its fp16 gradient is inf
in both runs, found by the data itself. Step :data:`POISON_STEP` writes an inf into one
gradient element on rank :data:`POISONED_RANK` only, after the engine's reduction and
before unscaling (the reference gets an inf in one gradient element at the same
point): every other rank's gradients are finite, so only the all-reduced flag can make
them skip.
"""

from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.plans.optim import AdamWConfig, LossScale, LRSchedule
from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
from areal_fn.runtime.engines.megatron import MegatronEngine
from areal_fn.runtime.engines.packed import TokenSequence
from areal_fn.strategy.parse import parse_allocation

FP16 = "+fp16"
STEPS = 6
#: a small start and a short interval, so that the scale grows within the run
LOSS_SCALE = LossScale(init_scale=1024.0, growth_interval=2)
#: warm-up: each optimizer step taken has its own rate (skipped steps take none)
ADAMW = AdamWConfig(lr=1e-3, schedule=LRSchedule(warmup_steps=4))
CLIP = 0.5
HUGE_STEP, HUGE_WEIGHT = 2, 1e8
POISON_STEP, POISONED_RANK = 4, 3
LENGTHS = (16, 5, 9, 12, 3, 16, 7, 10)
BUDGET = 16
#: a loss-scale state loaded back through ``load_scheduler_state``
RESUMED = {"scale": 64.0, "growth_tracker": 1}

FP16_CASES: tuple[tuple[str, str], ...] = (
    ("qwen2", "fsdp:d4" + FP16),
    ("qwen2", "fsdp:d2t2" + FP16),
    ("qwen2", "megatron:d2t2" + FP16),
    ("qwen2", "megatron:d2p2" + FP16),
    ("qwen2", "fsdp:t2c2" + FP16),  # Ulysses
    ("qwen2", "megatron:d2c2" + FP16),  # context parallelism
    ("mixtral", "fsdp:d4" + FP16),  # experts (Megatron's: see docs/engines.md)
)


def step_data(vocab: int, step: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(ids, loss_mask, weights)`` of every sequence of ``step`` (2 prompt tokens each)."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        out.append((ids, torch.arange(n) >= 2, 0.5 + torch.rand(n, generator=gen)))
    if step == HUGE_STEP:
        out[0][2][5] = HUGE_WEIGHT  # sequence 0 is data-parallel share 0's
    return out


def _loss(model: Any, vocab: int, step: int, *, fp16: bool) -> Tensor:
    """Mean weighted token loss of ``step``'s sequences, each run alone."""
    total, count = torch.zeros(()), 0.0
    for ids, mask, w in step_data(vocab, step):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(input_ids=ids[None]).logits[0, :-1]
        token_loss = F.cross_entropy(logits.float(), ids[1:], reduction="none")
        total = total + (token_loss * mask[1:].float() * w[1:]).sum()
        count += float(mask[1:].sum())
    return total / count


def control(spec: Any, model: Any, canonical_of: Any, skipped: list[bool]) -> list[Any]:
    """The same steps in float32 (no autocast, no scale; the AMP run's skips copied):
    how far fp16 rounding alone moves the AMP run. Per step: loss, weights."""
    opt = ADAMW.build(model.parameters())
    out, taken = [], 0
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, spec.vocab_size, step, fp16=False)
        loss.backward()
        if not skipped[step]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            ADAMW.set_lr(opt, taken)
            opt.step()
            taken += 1
        out.append((float(loss), canonical_of(model, spec)))
    return out


def reference(config: str, configs: dict[str, Any], randomized_model: Any, canonical_of: Any):
    """The single-process AMP run: per step its record and the canonical weights after it,
    and the float32 control's."""
    spec = model_from_hf_config(configs[config])
    model = randomized_model(spec, seed=11)
    w0 = canonical_of(model, spec)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=LOSS_SCALE.init_scale, growth_interval=LOSS_SCALE.growth_interval
    )
    opt = ADAMW.build(model.parameters())
    steps, taken = [], 0
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, spec.vocab_size, step, fp16=True)
        used = scaler.get_scale()
        scaler.scale(loss).backward()
        if step == POISON_STEP:
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        lr = ADAMW.set_lr(opt, taken)
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < used
        taken += not skipped
        state = scaler.state_dict()
        steps.append(
            {
                "loss": float(loss),
                "grad_norm": norm,
                "lr": lr,
                "loss_scale": used,
                "skipped": skipped,
                "scaler": {"scale": state["scale"], "growth_tracker": state["_growth_tracker"]},
                "w": canonical_of(model, spec),
            }
        )
    fp32 = control(
        spec, randomized_model(spec, seed=11), canonical_of, [s["skipped"] for s in steps]
    )
    for s, (loss32, w32) in zip(steps, fp32, strict=True):
        s["control_loss_rel_diff"] = abs(loss32 - s["loss"]) / abs(s["loss"])
        s["control_w"] = w32
    return {"spec": spec, "w0": w0, "steps": steps}


def _engine(spec: Any, label: str) -> Any:
    component = parse_allocation(label.removesuffix(FP16)).training
    if label.startswith("fsdp"):
        policy = PrecisionPolicy.fp32_params_fp16_compute()
        return Fsdp2Engine(
            spec,
            component,
            optimizer=ADAMW,
            grad_clip=CLIP,
            precision=_with_scale(policy),
        )
    return MegatronEngine(
        spec,
        component,
        optimizer=ADAMW,
        grad_clip=CLIP,
        precision=_with_scale(PrecisionPolicy.fp16_mixed()),
    )


def _with_scale(policy: PrecisionPolicy) -> PrecisionPolicy:
    return attrs.evolve(policy, loss_scale=LOSS_SCALE)


def _poison(engine: Any) -> Any:
    """``engine.local_grads`` with an inf written into one element on POISONED_RANK."""
    original = engine.local_grads

    def poisoned() -> dict[str, Tensor | None]:
        grads = original()
        if dist.get_rank() == POISONED_RANK:
            g = next(g for g in grads.values() if g is not None and g.numel())
            g.view(-1)[0] = float("inf")
        return grads

    return poisoned


def _movement_rel(w: dict[str, Tensor], ref: dict[str, Tensor], w0: dict[str, Tensor]) -> float:
    """``|(w - w0) - (ref - w0)| / |ref - w0|`` over every canonical element (L2, float64)."""
    num = sum(float((w[k].double() - ref[k].double()).square().sum()) for k in ref)
    den = sum(float((ref[k].double() - w0[k].double()).square().sum()) for k in ref)
    return (num / den) ** 0.5 if den else float("inf")


def run_fp16_case(label: str, ref: dict[str, Any]) -> dict[str, Any]:
    """The engine's steps beside the reference's, per step (every rank returns it)."""
    spec = ref["spec"]
    engine = _engine(spec, label)
    try:
        engine.load_canonical(ref["w0"])
        previous, out = engine.export_canonical(), []
        for step in range(STEPS):
            data = step_data(spec.vocab_size, step)
            mine = [
                TokenSequence(input_ids=ids, loss_mask=m, weights=w)
                for i, (ids, m, w) in enumerate(data)
                if i % engine.dp_size == engine.dp_rank
            ]
            if step == POISON_STEP:
                engine.local_grads = _poison(engine)
            try:
                stats = engine.train_step_packed(mine, max_tokens_per_micro_batch=BUDGET)
            finally:
                engine.__dict__.pop("local_grads", None)
            w = engine.export_canonical()
            want = ref["steps"][step]
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, stats["skipped"])
            out.append(
                {
                    "loss": stats["loss"],
                    "ref_loss": want["loss"],
                    "loss_rel_diff": abs(stats["loss"] - want["loss"]) / abs(want["loss"]),
                    "loss_scale": stats["loss_scale"],
                    "ref_loss_scale": want["loss_scale"],
                    "skipped_per_rank": gathered,
                    "ref_skipped": want["skipped"],
                    "scaler": engine.scaler.state_dict(),
                    "ref_scaler": want["scaler"],
                    "unchanged": all(torch.equal(w[k], previous[k]) for k in w),
                    "lr": stats["lr"],
                    "ref_lr": want["lr"],
                    "grad_norm": stats["grad_norm"],
                    "ref_grad_norm": want["grad_norm"],
                    "movement_rel_diff": _movement_rel(w, want["w"], ref["w0"]),
                    "control_loss_rel_diff": want["control_loss_rel_diff"],
                    "control_movement_rel_diff": _movement_rel(
                        want["control_w"], want["w"], ref["w0"]
                    ),
                    "weight_max_abs_diff": max(float((w[k] - want["w"][k]).abs().max()) for k in w),
                }
            )
            previous = w
        logp = engine.forward_logprobs_packed(mine, max_tokens_per_micro_batch=BUDGET)
        masters = getattr(engine, "_masters", {})  # Megatron: refreshed before the forward
        refreshed = all(torch.equal(engine._params[n], m.half()) for n, m in masters.items())
        opt = engine.optimizer_local_state()
        saved = engine.scheduler_state()
        engine.load_scheduler_state({"steps_done": 1, "loss_scale": RESUMED})
        return {
            "scheduler_state": saved,
            "params_are_rounded_masters": refreshed and len(masters) == len(engine._params),
            "logprobs_finite": all(bool(lp.isfinite().all()) for lp in logp),
            "resumed": [engine.steps_done, engine.scaler.state_dict()],
            "steps": out,
            "optimizer_steps": sorted({float(st["step"]) for st in opt.values()}),
            "master_dtypes": sorted({str(t.dtype) for t in engine.local_state().values()}),
            "model_dtypes": sorted({str(p.dtype) for p in engine._params.values()}),
        }
    finally:
        if isinstance(engine, MegatronEngine):
            engine.close()
