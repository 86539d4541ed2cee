"""Training engines: FSDP2 and Megatron-Core, built from the pure layouts.

Two engines with one interface (:class:`~areal_fn.runtime.engines.protocol.Engine`), both
executing a :class:`~areal_fn.layouts.layout.Layout` made by the pure core (they never
compute geometry of their own)::

    engine = Fsdp2Engine(spec, parse_allocation("fsdp:d2t2").training, optimizer=AdamWConfig(lr=1e-5))
    engine = MegatronEngine(spec, ParallelDims(tp=2, pp=2), optimizer=AdamWConfig(lr=1e-5))

    engine.load_canonical(canonical)              # HF checkpoint tensors -> this rank's pieces
    ids = split_rows(global_ids, engine.dp_size, engine.dp_rank)
    stats = engine.train_step(ids)                # {"loss", "grad_norm", "lr", "tokens", "clip_coef"}
    logp = engine.forward_logprobs(ids)           # [batch, seq - 1], full vocabulary
    shards = engine.local_state()                 # layout tensor name -> live local tensor
    canonical = engine.export_canonical()         # every rank gets every canonical tensor

- :class:`~areal_fn.runtime.engines.fsdp2.Fsdp2Engine`: a transformers model (eager
  attention, fp32 master weights) under FSDP2 (+ DTensor TP, + HSDP), torch AdamW.
- :class:`~areal_fn.runtime.engines.megatron.MegatronEngine`: Megatron-Core
  ``GPTModel`` chunks (TP/PP/VPP/EP, vocabulary padded as the layout says), Megatron's
  ``DistributedDataParallel`` and ``finalize_model_grads``, the pipeline schedules
  from ``get_forward_backward_func``; torch AdamW in place of Megatron's optimizer
  (which does not run on CPU, see ``docs/engines.md``).

This module holds what both share: the optimizer record, the loss definition, the
layout-driven gradient norm, batch splitting, and fp16's loss scale
(:class:`DynamicLossScaler`: under an fp16 ``PrecisionPolicy`` a step also returns
``loss_scale`` and ``skipped``; see :mod:`~areal_fn.runtime.engines.precision`). The engines are imported lazily
(``from areal_fn.runtime.engines import Fsdp2Engine`` imports only the FSDP2 one).

**Loss.** Both engines minimise the mean next-token cross entropy over every target
token of the *global* batch: ``sum over (b, t) of mask[b, t] * CE(logits[b, t-1], ids[b, t])``
divided by the number of target tokens summed over all data-parallel ranks (all-reduced,
so ranks may hold different token counts). Gradients are those of that one number.

**Gradient norm.** The global L2 norm over canonical parameters, each canonical
element counted once: every rank sums the squares of its local gradient pieces, each
piece weighted by ``1 / multiplicity`` of its canonical tensor (how many times the
layout holds each element: data-parallel and TP replicas, the tied embedding's second
copy on the last pipeline stage), and the sums are all-reduced over the world.
Padding rows (Megatron's padded vocabulary) are not canonical and do not count.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Bool, Float, Int
from torch import Tensor

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.lora import LoraError
from areal_fn.plans.grad_norm import canonical_multiplicity as canonical_multiplicity
from areal_fn.plans.grad_norm import norm_weights as norm_weights
from areal_fn.plans.optim import AdamWConfig as AdamWConfig
from areal_fn.plans.optim import LossScale as LossScale
from areal_fn.plans.optim import LRSchedule as LRSchedule
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

__all__ = [  # noqa: F822 (the engines load lazily, see __getattr__)
    "AdamWConfig",
    "DynamicLossScaler",
    "Fsdp2Engine",
    "LRSchedule",
    "LossScale",
    "MegatronEngine",
    "OptimizerSteps",
    "adamw_local_state",
    "canonical_multiplicity",
    "clip_grads_",
    "grad_norm",
    "next_token_targets",
    "norm_weights",
    "split_rows",
    "trained_adapters",
]


#: Token ids ``[batch, seq]`` and their loss mask; targets/log-probs drop the first column.
TokenIds = Int[Tensor, "batch seq"]
TokenMask = Bool[Tensor, "batch seq"]
Targets = Int[Tensor, "batch seq_1"]
TargetMask = Bool[Tensor, "batch seq_1"]
TokenLogprobs = Float[Tensor, "batch seq_1"]


class OptimizerSteps:
    """What both engines share about their optimizer: the scheduled step, the LR
    schedule's checkpointable state and the AdamW state per local tensor.

    Engines set ``optimizer``, ``optimizer_config``, ``_params`` (local name ->
    parameter), ``_weights`` (:func:`norm_weights` of their rank), ``grad_clip`` and
    ``steps_done = 0``.
    """

    optimizer: torch.optim.Optimizer
    optimizer_config: AdamWConfig
    _params: Mapping[str, torch.nn.Parameter]
    _weights: Mapping[str, Sequence[tuple[Box, float]]]
    grad_clip: float | None
    steps_done: int
    #: fp16's loss scale (``None``: no scaling); engines set it
    scaler: "DynamicLossScaler | None" = None

    @property
    def loss_scale(self) -> float:
        """The factor this step's loss is multiplied by before backward (1 without fp16)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def _optimizer_params(self) -> Mapping[str, Tensor]:
        """The tensors the optimizer steps, by layout name (fp16 masters where kept)."""
        return self._params

    def _optimizer_step(self) -> float:
        """Set this step's learning rate, step the optimizer; returns the rate used."""
        lr = self.optimizer_config.set_lr(self.optimizer, self.steps_done)
        self.optimizer.step()
        self.steps_done += 1
        return lr

    def _clip_and_step(
        self, grads: Mapping[str, Tensor | None], *, loss_sum: float, tokens: float
    ) -> dict[str, float]:
        """The end of a train step, after backward: norm, clip, scheduled step, the record.

        ``grads`` are this rank's local gradients by layout tensor name, the ones the
        optimizer steps on (clipped in place); ``loss_sum`` and ``tokens`` are the
        global summed token loss and target count (``tokens > 0``). Returns ``loss``
        (their ratio), ``grad_norm`` (before clipping), ``clip_coef``, ``lr``, ``tokens``.
        """
        live = [g for g in grads.values() if g is not None]
        out = {"loss": loss_sum / tokens, "tokens": tokens}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
            skipped = self.scaler.unscale_(live)
            self.scaler.update(skipped)
            out["skipped"] = float(skipped)
            if skipped:  # every rank alike: nothing clipped, no optimizer step
                lr = self.optimizer_config.lr_at(self.steps_done)
                return out | {"grad_norm": math.inf, "clip_coef": 0.0, "lr": lr}
        norm = grad_norm(grads, self._weights)
        coef = clip_grads_(live, norm, self.grad_clip)
        lr = self._optimizer_step()
        return out | {"grad_norm": norm, "clip_coef": coef, "lr": lr}

    def scheduler_state(self) -> dict[str, Any]:
        """The LR schedule's state (for checkpoints' ``lr_scheduler``): ``steps_done``,
        and under fp16 ``loss_scale`` (:meth:`DynamicLossScaler.state_dict`)."""
        state: dict[str, Any] = {"steps_done": self.steps_done}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        return state

    def load_scheduler_state(self, state: Mapping[str, Any]) -> None:
        """Resume the LR schedule from :meth:`scheduler_state`; under fp16 also the loss
        scale when the state has one (without fp16, a saved scale is not used)."""
        steps = state.get("steps_done")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise SpecError(
                f"scheduler state {dict(state)!r} has no valid 'steps_done' (an int >= 0)"
            )
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
        self.steps_done = steps

    def optimizer_local_state(self, *, create: bool = False) -> dict[str, dict[str, Tensor]]:
        """AdamW state per local tensor: ``{name: {"exp_avg", "exp_avg_sq", "step"}}``.

        Live tensors with the local shards' shapes (the layout's pieces describe them
        too): write into them in place to restore a checkpoint. Empty before the first
        step unless ``create`` (zero moments, step 0, which the next step then uses).
        """
        return adamw_local_state(self.optimizer, self._optimizer_params(), create=create)


class DynamicLossScaler:
    """fp16's loss scale at run time: ``torch.amp.GradScaler``'s arithmetic, one flag
    all-reduced over ``group`` (default: the world).

    :meth:`unscale_` multiplies the gradients by ``1 / scale`` (the scale is a power of
    the growth and backoff factors, so for the defaults exact) and finds any inf or
    NaN with torch's own kernel; the flag is all-reduced (MAX), so every rank skips the
    same steps. :meth:`update` applies ``torch._amp_update_scale_``: backoff on a skip,
    growth after ``growth_interval`` good steps in a row.
    """

    def __init__(
        self,
        config: LossScale,
        *,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self._scale = torch.full((), config.init_scale, dtype=torch.float32, device=device)
        self._growth = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def scale(self) -> float:
        return float(self._scale)

    def unscale_(self, grads: Sequence[Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; whether any rank's hold an inf/NaN."""
        found = torch.zeros((1,), dtype=torch.float32, device=self._scale.device)
        inv = self._scale.double().reciprocal().float().reshape(1)
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:  # by device (offloaded gradients live on the host) and dtype
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), same in groups.items():
            here = torch.zeros((1,), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(same, here, inv.to(device))
            found += here.to(found.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item() > 0)

    def update(self, skipped: bool) -> None:
        """The scale after a step that was (``skipped``) or was not skipped."""
        flag = torch.full((1,), float(skipped), dtype=torch.float32, device=self._scale.device)
        scale = self._scale.reshape(1)
        torch._amp_update_scale_(
            scale,
            self._growth.reshape(1),
            flag,
            self.config.growth_factor,
            self.config.backoff_factor,
            self.config.growth_interval,
        )

    def state_dict(self) -> dict[str, float | int]:
        """``{"scale", "growth_tracker"}``: what resumes the law (``torch.amp.GradScaler``'s names)."""
        return {"scale": self.scale, "growth_tracker": int(self._growth)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`."""
        scale, growth = state.get("scale"), state.get("growth_tracker")
        if not isinstance(scale, float) or not scale > 0 or not isinstance(growth, int):
            raise SpecError(
                f"loss-scale state {dict(state)!r} needs 'scale' (a float > 0) and "
                "'growth_tracker' (an int); pass DynamicLossScaler.state_dict()"
            )
        self._scale.fill_(scale)
        self._growth.fill_(growth)


# -- pure: batches and targets ----------------------------------------------------------
@beartype
def split_rows(batch: Tensor, parts: int, index: int) -> Tensor:
    """Rows ``[index * n, (index + 1) * n)`` of ``batch``, ``n = len(batch) / parts``.

    How a global batch is dealt to ``parts`` data-parallel ranks; refuses to drop or pad
    rows when ``parts`` does not divide the batch.
    """
    rows = batch.shape[0]
    if parts < 1 or not 0 <= index < parts:
        raise SpecError(f"index={index} must lie in 0..{parts - 1} (parts={parts})")
    if rows % parts:
        raise SpecError(
            f"a global batch of {rows} rows does not split evenly over {parts} data-parallel "
            f"ranks; use a batch size that is a multiple of {parts}"
        )
    n = rows // parts
    return batch[index * n : (index + 1) * n]


@beartype
def next_token_targets(
    input_ids: TokenIds, loss_mask: TokenMask | None = None
) -> tuple[Targets, TargetMask]:
    """Targets ``input_ids[:, 1:]`` and which of them count (``loss_mask[:, 1:]``, default all).

    ``loss_mask[b, t]`` says whether token ``t`` of row ``b`` is a target (predicted from
    position ``t - 1``); column 0 is never a target.
    """
    if input_ids.shape[1] < 2:
        raise SpecError(
            f"input_ids of shape {tuple(input_ids.shape)} has no next token to predict; "
            "sequences need at least 2 tokens"
        )
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise SpecError(
            f"loss_mask shape {tuple(loss_mask.shape)} differs from input_ids shape "
            f"{tuple(input_ids.shape)}; give one flag per token"
        )
    targets = input_ids[:, 1:]
    mask = torch.ones_like(targets, dtype=torch.bool) if loss_mask is None else loss_mask[:, 1:]
    return targets, mask


# -- runtime: norm and clipping ----------------------------------------------------------
def grad_norm(
    grads: Mapping[str, Tensor | None],
    weights: Mapping[str, Sequence[tuple[Box, float]]],
    *,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The global L2 norm of the gradients the layout describes (collective over ``group``).

    ``grads`` maps this rank's local tensor names to local gradients (``None`` = zero);
    ``weights`` is :func:`norm_weights` of the same rank. Squares are summed in float64.
    """
    missing = sorted(set(weights) - set(grads))
    if missing:
        raise LayoutError(
            f"no gradient entry for layout tensors {missing[:5]}; pass every local tensor "
            "(None for a zero gradient)"
        )
    device = next((g.device for g in grads.values() if g is not None), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for name, pieces in weights.items():
        g = grads[name]
        if g is None:
            continue
        for box, w in pieces:
            total += w * g[box.slices()].double().square().sum()
    dist.all_reduce(total, group=group)
    return float(total.sqrt())


def clip_grads_(grads: Sequence[Tensor], norm: float, max_norm: float | None) -> float:
    """Scale ``grads`` in place like ``torch.nn.utils.clip_grad_norm_``; returns the factor.

    The factor is ``min(1, max_norm / (norm + 1e-6))``; ``max_norm=None`` leaves the
    gradients alone (factor 1).
    """
    if max_norm is None:
        return 1.0
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0 and grads:
        torch._foreach_mul_(list(grads), coef)
    return coef


def adamw_local_state(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, Tensor],
    *,
    create: bool = False,
) -> dict[str, dict[str, Tensor]]:
    """AdamW state by layout tensor name: ``{"exp_avg", "exp_avg_sq", "step"}``, live tensors.

    The moments are this rank's local shards (a DTensor's local tensor), sharing
    storage with the optimizer's state, so writing into them in place restores a
    checkpoint; ``step`` is the optimizer's own scalar tensor. Parameters without state
    (before the first step) are left out, or with ``create`` given zero moments and
    step 0 first (what ``torch.optim.AdamW`` would create, which it then uses).
    """
    out: dict[str, dict[str, Tensor]] = {}
    for name, p in params.items():
        state = optimizer.state[p]
        if not state:
            if not create:
                continue
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[name] = {
            "exp_avg": _local_of(state["exp_avg"]).detach(),
            "exp_avg_sq": _local_of(state["exp_avg_sq"]).detach(),
            "step": state["step"],
        }
    return out


def _step_dtype() -> torch.dtype:
    # torch.optim keeps ``step`` as a float32 scalar tensor (float64 when the default
    # dtype is float64).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _local_of(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def trained_adapters(adapter_layout: Layout | None) -> Layout:
    """An engine's adapter layout; ``LoraError`` for an engine that trains no adapters."""
    if adapter_layout is None:
        raise LoraError("this engine trains no LoRA adapters; build it with lora=LoraConfig(...)")
    return adapter_layout
