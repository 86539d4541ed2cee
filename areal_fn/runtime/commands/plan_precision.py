"""``areal-fn plan``'s precision: the ``--float8-recipe`` flag (checked against the
allocation as the engines check it), the FP8 copies it adds to a training component's
memory, and the lines and JSON that say which policy was counted.

``--float8-recipe R`` counts torchao's float8 training (``Fsdp2RunOptions(float8_recipe=R)``)
of every fsdp component: fp32 parameters, gradients and AdamW states (the engine runs
float8 over plain fp32 linear layers, so ``--precision`` is fp32) and, in ``buffers``,
the FP8 copies of :func:`~areal_fn.plans.memory.float8.float8_copies` (the weight copy;
with ``--seq-len`` the input and gradient copies of ``--micro-batch`` sequences too).
It is refused where the engines refuse it: a megatron component (``MegatronRunOptions``
refuses every ``fp8_recipe``: Transformer Engine's FP8 needs its layer spec and an FP8
GPU), tp > 1, LoRA, a 16-bit ``--precision``.
"""

import argparse
from typing import Any

from areal_fn.errors import SpecError
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.memory import MemoryReport
from areal_fn.plans.memory.float8 import Float8Copies, float8_copies, with_float8
from areal_fn.plans.precision import named_policy, policy_line
from areal_fn.strategy.allocation import Allocation, Backend, Component

__all__ = ["check_float8_flag", "float8_json", "float8_of", "precision_lines", "with_float8_of"]


def check_float8_flag(model: ModelSpec, alloc: Allocation, args: argparse.Namespace) -> None:
    """Refuse ``--float8-recipe`` where the engines refuse float8 training, in CLI terms;
    with it and no ``--precision``, count fp32 (what the engine runs)."""
    recipe = args.float8_recipe
    if recipe is None:
        return
    flag = f"--float8-recipe {recipe}"
    head = f"{flag} counts torchao's float8 training, which runs in the FSDP2 engine"
    for comp in alloc.components:
        if comp.backend is Backend.MEGATRON:
            raise SpecError(
                f"{head}; {comp} is megatron, whose engine refuses every fp8_recipe (Transformer "
                "Engine's FP8 needs its layer spec and an FP8 GPU): plan fsdp components only, "
                f"or drop {flag}"
            )
        if comp.backend is Backend.FSDP and comp.dims.tp > 1:
            raise SpecError(
                f"{head}; with tp={comp.dims.tp} ({comp}) it needs torchao's float8 TP styles, "
                f"which the engine's TP plan does not use: use t1, or drop {flag}"
            )
    if not any(c.backend is Backend.FSDP for c in alloc.components):
        raise SpecError(f"{head}; {alloc} has no fsdp component: drop {flag}")
    if args.lora_rank is not None:
        raise SpecError(
            f"{head} over plain fp32 linear layers, not with LoRA adapters (--lora-rank): "
            f"drop one of them"
        )
    if "precision" in args.given and args.precision != "fp32":
        raise SpecError(
            f"{head} over plain fp32 linear layers (fp32 parameters, gradients and Adam "
            f"states), not under --precision {args.precision}: drop --precision (fp32 is "
            "counted)"
        )
    float8_copies(model, recipe)  # refuses a model with no linear layer to convert
    args.precision = "fp32"


def float8_of(model: ModelSpec, comp: Component, args: argparse.Namespace) -> Float8Copies | None:
    """The FP8 copies ``--float8-recipe`` counts for ``comp`` (None without the flag):
    the weight copy, and with ``--seq-len`` those of a micro-batch's tokens on a rank."""
    if args.float8_recipe is None or comp.backend is not Backend.FSDP:
        return None
    tokens = 0
    if args.seq_len is not None:
        tokens = -(-args.micro_batch * args.seq_len // comp.dims.cp)
    return float8_copies(model, args.float8_recipe, tokens=tokens)


def with_float8_of(
    model: ModelSpec, comp: Component, report: MemoryReport, args: argparse.Namespace
) -> MemoryReport:
    """``report`` with the FP8 copies of ``--float8-recipe`` in its buffers."""
    copies = float8_of(model, comp, args)
    return report if copies is None else with_float8(report, copies)


def float8_json(
    model: ModelSpec, comp: Component, args: argparse.Namespace
) -> dict[str, Any] | None:
    """The ``float8`` object of a training component's memory (None without the flag)."""
    c = float8_of(model, comp, args)
    if c is None:
        return None
    return {
        "recipe": c.recipe,
        "linears": c.linears,
        "layer": c.layer,
        "tokens": c.tokens,
        "weight_bytes": c.weight_bytes,
        "activation_bytes": c.activation_bytes,
        "buffer_bytes": c.total,
    }


def _engine_note(policy_name: str) -> str:
    """What the FSDP2 engine runs where it does not run ``--precision`` as named."""
    how = {
        "bf16": "bfloat16 through FSDP2's mixed precision (Fsdp2RunOptions(param_dtype="
        "'bfloat16', reduce_dtype='float32'); the unsharded bf16 copies are in flight only)",
        "fp16": "float16 under torch.autocast with the loss scale",
    }[policy_name]
    return (
        "; FSDP2 keeps fp32 sharded parameters, gradients and Adam states (the optimizer's "
        f"weights, no master copy) and computes in {how}"
    )


def precision_lines(
    model: ModelSpec, comp: Component, report: MemoryReport, args: argparse.Namespace
) -> list[str]:
    """The policy counted for a training component, and its FP8 copies if any."""
    line = f"precision (--precision {args.precision}): {policy_line(report.policy)}"
    if report.policy != named_policy(args.precision):
        line += _engine_note(args.precision)
    lines = [line]
    if (c := float8_of(model, comp, args)) is not None:
        acts = (
            f" and of its input and gradients over {c.tokens:,} tokens ({c.activation_bytes:,} B)"
            if c.tokens
            else " (pass --seq-len for those of its input and gradients)"
        )
        lines.append(
            f"float8 (--float8-recipe {c.recipe}): torchao's Float8Linear on {c.linears} linear "
            f"layers (fp32 parameters, gradients and Adam states, no FP8 copy kept between "
            f"steps); in buffers: the FP8 copies of one layer at a time, at most "
            f"{c.total:,} B at {c.layer}: its weight ({c.weight_bytes:,} B){acts}; their "
            "scales are not counted"
        )
    return lines
