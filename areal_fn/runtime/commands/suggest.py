"""``areal-fn plan CONFIG --suggest N --device-memory SIZE``: ranked training strategies.

The assumptions of the estimate are printed first, each with the flag that sets it:
sequence length, micro-batch, global batch, recompute, GPUs per node, optimizer
offload, the dtypes of gradients, master weights and Adam moments, the MoE token
dispatcher the EP all-to-all is scored for, and the margin of device memory kept free
for what the estimate leaves out (CUDA context, NCCL communication buffers, allocator
fragmentation).
"""

import argparse
from typing import Any

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.lora import LoraConfig, default_targets, lora_param_count, lora_targets
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.advisor import Hardware, Suggestion, suggest_strategy
from areal_fn.plans.advisor.score import EP_DISPATCHES
from areal_fn.plans.memory import ActivationModel, PrecisionPolicy
from areal_fn.plans.precision import engine_policy, named_policy, policy_json
from areal_fn.runtime.commands.output import emit_json, human, parse_size
from areal_fn.strategy.allocation import Backend

__all__ = [
    "LEFT_OUT",
    "cmd_suggest",
    "lora_json",
    "lora_line",
    "lora_of",
    "memory_margin_of",
    "model_json",
    "usable_bytes",
]

#: What the memory estimate does not count, kept free by the margin.
LEFT_OUT = (
    "CUDA context and kernels",
    "NCCL communication buffers",
    "allocator fragmentation",
    "temporary tensors outside the activation model",
)


def stored_quantization(config: str) -> str | None:
    """How the published checkpoint of ``config`` (as ``plan`` takes it) stores its
    weights when quantised (:func:`~areal_fn.model.quantized.checkpoint_quantization`)."""
    from areal_fn.model.quantized import checkpoint_quantization
    from areal_fn.model.spec import load_hf_config

    return checkpoint_quantization(load_hf_config(config))


def stored_line(model: ModelSpec, config: str) -> str | None:
    """The line that says sizes are in ``model.dtype`` while the checkpoint of ``config``
    is stored quantised; None when it is not."""
    stored = stored_quantization(config)
    if stored is None:
        return None
    return (
        f"sizes are of {model.dtype} weights, as the engines hold them; the published "
        f"checkpoint stores its weights as {stored} (quantization_config), which is not "
        "what is sized here"
    )


def model_json(model: ModelSpec, config: str) -> dict[str, Any]:
    """The ``model`` object of the JSON documents."""
    return {
        "config": config,
        "model_type": model.model_type,
        "num_layers": model.num_layers,
        "mtp_layers": model.mtp_layers,
        "num_params": model.num_params,
        "dtype": model.dtype,
        "checkpoint_quantization": stored_quantization(config),
    }


#: ``--seq-len`` when not given.
DEFAULT_SEQ_LEN = 4096


def seq_len_of(args: argparse.Namespace) -> int:
    """``--seq-len``, or :data:`DEFAULT_SEQ_LEN` when it was not given."""
    return DEFAULT_SEQ_LEN if args.seq_len is None else int(args.seq_len)


#: Dtype spellings of ``--grad-dtype``, ``--master-dtype`` and ``--adam-dtype``.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype(flag: str, value: str, *, none: bool = False) -> str | None:
    """``value`` of ``flag`` as a torch dtype name (``None`` for ``none`` where allowed)."""
    if none and value == "none":
        return None
    if value not in DTYPES:
        valid = ", ".join([*DTYPES, *(["none"] if none else [])])
        raise SpecError(f"{flag} {value!r} is not a dtype here; use one of {valid}")
    return DTYPES[value]


def policy_of(args: argparse.Namespace) -> PrecisionPolicy:
    """The precision policy of ``--precision`` (its parameter and compute dtypes, its loss
    scale; Adam) with ``--grad-dtype``, ``--master-dtype`` and ``--adam-dtype``; the
    master copy is ``--precision``'s own (none under fp32) unless ``--master-dtype`` is
    given."""
    base = named_policy(args.precision)
    grad = _dtype("--grad-dtype", args.grad_dtype)
    master = _dtype("--master-dtype", args.master_dtype, none=True)
    if "master_dtype" not in getattr(args, "given", ()):
        master = base.master_dtype if base.master_weights else None
    state = _dtype("--adam-dtype", args.adam_dtype)
    return attrs.evolve(
        base,
        grad_dtype=grad,
        master_weights=master is not None,
        master_dtype=master or "float32",
        state_dtype=state,
    )


def _short(dtype: str | None) -> str:
    """``float32`` -> ``fp32`` (the dtype flags' spelling); ``None`` -> ``none``."""
    return next((k for k, v in DTYPES.items() if v == dtype), "none")


def lora_of(model: ModelSpec, args: argparse.Namespace) -> LoraConfig | None:
    """``--lora-rank R``: LoRA of rank R on :func:`~areal_fn.model.lora.default_targets`;
    None without the flag. A rank above the smallest dimension of a targeted layer is
    refused (its adapters would add parameters, not rank)."""
    if args.lora_rank is None:
        return None
    config = LoraConfig(rank=args.lora_rank, target_modules=default_targets(model))
    smallest = min(min(t.in_features, t.out_features) for t in lora_targets(model, config))
    if args.lora_rank > smallest:
        raise SpecError(
            f"--lora-rank {args.lora_rank} is above {smallest}, the smallest dimension of a "
            f"layer it adapts in {model.model_type}; use --lora-rank in 1..{smallest}"
        )
    return config


def lora_json(model: ModelSpec, config: LoraConfig | None) -> dict[str, Any] | None:
    """The ``lora`` object of the JSON documents (None without ``--lora-rank``)."""
    if config is None:
        return None
    return {
        "rank": config.rank,
        "target_modules": list(config.target_modules),
        "adapter_params": lora_param_count(model, config),
    }


def lora_line(model: ModelSpec, config: LoraConfig) -> str:
    """What ``--lora-rank`` counts, in one line."""
    n = lora_param_count(model, config)
    return (
        f"LoRA rank {config.rank} (--lora-rank) on {', '.join(config.target_modules)}: {n:,} "
        f"adapter parameters trained (weights, gradients, optimizer state); the "
        f"{model.num_params:,} base parameters frozen (weights only)"
    )


def memory_margin_of(args: argparse.Namespace) -> float:
    """``--memory-margin``, checked: a fraction in [0, 1)."""
    margin = float(args.memory_margin)
    if not 0 <= margin < 1:
        raise SpecError(
            f"--memory-margin {args.memory_margin} must be in [0, 1): the fraction of device "
            "memory kept free (e.g. 0.1)"
        )
    return margin


def usable_bytes(device_bytes: int, margin: float) -> int:
    """What a strategy may use of ``device_bytes``: ``floor(device_bytes * (1 - margin))``."""
    return int(device_bytes * (1 - margin))


def _assumptions(args: argparse.Namespace, device_bytes: int) -> dict[str, Any]:
    margin = memory_margin_of(args)
    for flag, value in (
        ("--seq-len", seq_len_of(args)),
        ("--micro-batch", args.micro_batch),
        ("--global-batch", args.global_batch),
        ("--gpus-per-node", args.gpus_per_node),
    ):
        if value < 1:
            raise SpecError(f"{flag} {value} must be >= 1")
    if args.ep_dispatch not in EP_DISPATCHES:
        raise SpecError(
            f"--ep-dispatch {args.ep_dispatch!r} is not a token dispatcher the score models; "
            f"use one of {', '.join(EP_DISPATCHES)}"
        )
    margin_bytes = device_bytes - usable_bytes(device_bytes, margin)
    policy = policy_of(args)
    return {
        "seq_len": seq_len_of(args),
        "micro_batch": args.micro_batch,
        "global_batch": args.global_batch,
        "recompute": args.recompute,
        "gpus_per_node": args.gpus_per_node,
        "optimizer_offload": args.optimizer_offload,
        "policy": str(policy),
        "precision": args.precision,
        "precision_policy": policy_json(policy),
        "fsdp_policy": str(engine_policy(policy, Backend.FSDP)),
        "grad_dtype": args.grad_dtype,
        "master_dtype": _short(policy.master_dtype if policy.master_weights else None),
        "adam_dtype": args.adam_dtype,
        "ep_dispatch": args.ep_dispatch,
        "memory_margin": margin,
        "margin_bytes": margin_bytes,
        "usable_bytes": device_bytes - margin_bytes,
        "left_out": list(LEFT_OUT),
        "lora": None,
    }


#: How the assumptions line words each ``--ep-dispatch``.
_DISPATCH_WORDS = {
    "alltoall": "alltoall dispatcher, one copy per token and expert",
    "deepep": "deepep dispatcher, one copy per destination rank in a node and per node across",
}


def _assumption_lines(a: dict[str, Any], device_bytes: int) -> list[str]:
    on = {True: "on", False: "off"}
    offload = "in host memory" if a["optimizer_offload"] else "on the device"
    return [
        "assumptions (each set by the flag shown):",
        f"  sequence length {a['seq_len']} tokens (--seq-len), micro-batch {a['micro_batch']} "
        f"sequences (--micro-batch), global batch {a['global_batch']} sequences per step "
        f"(--global-batch)",
        f"  recompute {on[a['recompute']]} (--recompute / --no-recompute), "
        f"{a['gpus_per_node']} GPUs per node (--gpus-per-node), optimizer state {offload} "
        f"(--optimizer-offload)",
        f"  precision {a['precision']} (--precision): {a['policy']} (--grad-dtype "
        f"{a['grad_dtype']}, --master-dtype {a['master_dtype']}, --adam-dtype {a['adam_dtype']})"
        + (
            f"; fsdp candidates as Fsdp2Engine runs it: {a['fsdp_policy']}"
            if a["fsdp_policy"] != a["policy"]
            else ""
        ),
        f"  EP all-to-all: {_DISPATCH_WORDS[a['ep_dispatch']]} (--ep-dispatch {a['ep_dispatch']})",
        f"  margin: {a['memory_margin']:.0%} of {device_bytes:,} bytes ({human(a['margin_bytes'])})"
        f" kept free for what the estimate leaves out ({', '.join(a['left_out'])}); a "
        f"strategy fits when its estimate is at most {a['usable_bytes']:,} bytes "
        f"({human(a['usable_bytes'])}) (--memory-margin)",
    ]


def _suggestion_json(i: int, s: Suggestion) -> dict[str, Any]:
    p = s.memory.max_rank
    return {
        "rank": i,
        "allocation": s.allocation,
        "peak_bytes": p.total,
        "peak_rank": p.rank,
        "params": p.params,
        "grads": p.grads,
        "optimizer": p.optimizer,
        "activations": p.activations,
        "buffers": p.buffers,
        "step_seconds": s.score,
        "policy": str(s.memory.policy),
        "why": s.why,
    }


def cmd_suggest(console: Any, model: ModelSpec, args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.device_memory is None:
        raise SpecError("--suggest needs --device-memory (e.g. 80GB or 80GiB)")
    device_bytes = parse_size(args.device_memory)
    a = _assumptions(args, device_bytes)
    lora = lora_of(model, args)
    a["lora"] = lora_json(model, lora)
    found = suggest_strategy(
        model,
        args.suggest,
        device_bytes,
        policy=policy_of(args),
        activation=ActivationModel(
            micro_batch_size=a["micro_batch"], seq_len=a["seq_len"], recompute=a["recompute"]
        ),
        top=args.top,
        global_batch_size=a["global_batch"],
        memory_margin=a["memory_margin"],
        hardware=Hardware(devices_per_node=a["gpus_per_node"], ep_dispatch=a["ep_dispatch"]),
        optimizer_offload=a["optimizer_offload"],
        lora=lora,
    )
    if args.json:
        emit_json(
            {
                "schema": "areal-fn.suggest/1",
                "model": model_json(model, args.config),
                "devices": args.suggest,
                "device_memory_bytes": device_bytes,
                "assumptions": a,
                "suggestions": [_suggestion_json(i, s) for i, s in enumerate(found, 1)],
            }
        )
        return 0
    lines = _assumption_lines(a, device_bytes)
    if lora is not None:
        lines.append(f"  {lora_line(model, lora)}; the score is that of full training")
    for line in [*lines, stored_line(model, args.config)]:
        if line is not None:
            console.print(line, markup=False, highlight=False)
    table = Table(
        title=f"strategies for {model.model_type} ({model.num_params:,} parameters) on "
        f"{args.suggest} devices of {args.device_memory}"
    )
    for col in ("#", "allocation", "peak memory", "score (s/step)"):
        table.add_column(col, no_wrap=True)
    for i, sgn in enumerate(found, 1):
        table.add_row(str(i), sgn.allocation, human(sgn.memory.max_rank.total), f"{sgn.score:.3g}")
    console.print(table)
    for i, sgn in enumerate(found, 1):
        console.print(f"{i}. {sgn.why}")
    return 0
