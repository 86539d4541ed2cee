"""Which flags of ``areal-fn plan`` apply to what, their defaults, and plan's size limit.

``plan CONFIG ALLOCATION`` and ``plan CONFIG --suggest N`` share one parser; a flag the
chosen form does not use is refused in one line naming it (never silently ignored).
The parser leaves these flags ``None`` so that a flag given can be told from one left
out; :func:`check_plan_flags` refuses what does not apply and then fills in the
defaults (:data:`DEFAULTS`).
"""

import argparse

from areal_fn.errors import SpecError

__all__ = ["DEFAULTS", "MAX_PLAN_RANKS", "check_plan_flags", "check_plan_ranks"]

#: The most ranks ``plan`` takes (an allocation's world size, ``--suggest N``): it
#: estimates every rank's memory, and beyond this many ranks that takes minutes.
MAX_PLAN_RANKS = 2**14

#: ``dest -> (flag, default)`` of the flags the parser leaves ``None`` when not given.
DEFAULTS: dict[str, tuple[str, object]] = {
    "tensors": ("--tensors", 0),
    "max_ranks": ("--max-ranks", 16),
    "context_len": ("--context-len", 4096),
    "batch": ("--batch", 1),
    "top": ("--top", 5),
    "micro_batch": ("--micro-batch", 1),
    "global_batch": ("--global-batch", 256),
    "recompute": ("--recompute", True),
    "gpus_per_node": ("--gpus-per-node", 8),
    "optimizer_offload": ("--optimizer-offload", False),
    "grad_dtype": ("--grad-dtype", "fp32"),
    "master_dtype": ("--master-dtype", "fp32"),
    "adam_dtype": ("--adam-dtype", "fp32"),
    "ep_dispatch": ("--ep-dispatch", "alltoall"),
    "memory_margin": ("--memory-margin", 0.1),
    "precision": ("--precision", "bf16"),
}

#: Flags only ``--suggest`` uses.
_SUGGEST_ONLY = (
    "top",
    "global_batch",
    "gpus_per_node",
    "optimizer_offload",
    "grad_dtype",
    "master_dtype",
    "adam_dtype",
    "ep_dispatch",
)

#: Flags only the plan of an ALLOCATION uses.
_ALLOCATION_ONLY = ("tensors", "max_ranks", "png", "context_len", "batch", "float8_recipe")

#: Integer flags, the least value each takes, and what it counts.
_AT_LEAST = (
    ("tensors", 0, "how many tensors to list (0: none)"),
    ("max_ranks", 0, "rows of the per-rank table before it is summarised"),
    ("context_len", 1, "tokens per sequence of the KV cache"),
    ("batch", 1, "sequences per engine replica of the KV cache"),
    ("top", 1, "how many suggestions to show"),
)


def _flag(dest: str, args: argparse.Namespace) -> str:
    if dest in ("png", "float8_recipe"):
        return "--" + dest.replace("_", "-")
    if dest == "recompute":
        return "--recompute" if args.recompute else "--no-recompute"
    return DEFAULTS[dest][0]


def _first_given(args: argparse.Namespace, dests: tuple[str, ...]) -> str | None:
    """The first of ``dests`` given on the command line (None: none of them)."""
    return next((d for d in dests if getattr(args, d) is not None), None)


def check_plan_ranks(what: str, ranks: int) -> None:
    """``SpecError`` when ``ranks`` (``what``: ``ALLOCATION fsdp:d8 has`` or ``--suggest 8
    asks for``) is more than :data:`MAX_PLAN_RANKS`."""
    if ranks > MAX_PLAN_RANKS:
        raise SpecError(
            f"{what} {ranks} ranks, more than plan's limit of {MAX_PLAN_RANKS} (2**14): plan "
            f"estimates every rank's memory, which takes minutes beyond that; plan at most "
            f"{MAX_PLAN_RANKS} ranks, or call areal_fn.plans.memory.estimate_memory from Python "
            "(no limit)"
        )


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse the flags of ``plan`` that do not apply to the form given (ALLOCATION or
    ``--suggest N``) and values out of range, in one line each; then fill in the
    defaults of the flags not given."""
    if args.suggest is not None:
        if args.suggest < 1:
            raise SpecError(
                f"--suggest {args.suggest} must be >= 1: the number of devices to rank "
                "training strategies for"
            )
        check_plan_ranks(f"--suggest {args.suggest} asks for", args.suggest)
        if args.allocation is not None:
            raise SpecError(
                f"--suggest ranks strategies of its own and does not plan the ALLOCATION "
                f"{args.allocation}: drop {args.allocation}, or drop --suggest to plan it"
            )
        if (dest := _first_given(args, _ALLOCATION_ONLY)) is not None:
            raise SpecError(
                f"{_flag(dest, args)} applies to plan of an ALLOCATION; --suggest does not use "
                "it: drop it"
            )
    else:
        if (dest := _first_given(args, _SUGGEST_ONLY)) is not None:
            raise SpecError(
                f"{_flag(dest, args)} applies to --suggest N; plan of an ALLOCATION does not "
                "use it: drop it, or pass --suggest N instead of the ALLOCATION"
            )
        if args.seq_len is None:
            if (dest := _first_given(args, ("micro_batch", "recompute"))) is not None:
                raise SpecError(
                    f"{_flag(dest, args)} shapes the activations, which plan of an ALLOCATION "
                    f"counts only with --seq-len: pass --seq-len N, or drop {_flag(dest, args)}"
                )
        if args.json and args.max_ranks is not None:
            raise SpecError(
                "--max-ranks sets the rows of the text tables; --json lists every rank: drop "
                "--max-ranks"
            )
    if args.memory_margin is not None and args.device_memory is None:
        raise SpecError(
            "--memory-margin is the fraction of --device-memory kept free; pass --device-memory "
            "SIZE, or drop --memory-margin"
        )
    for dest, least, meaning in _AT_LEAST:
        value = getattr(args, dest)
        if value is not None and value < least:
            raise SpecError(f"{_flag(dest, args)} {value} must be >= {least}: {meaning}")
    if args.lora_rank is not None and args.lora_rank < 1:
        raise SpecError(f"--lora-rank {args.lora_rank} must be >= 1: the rank r of the adapters")
    args.given = frozenset(d for d in (*DEFAULTS, "png") if getattr(args, d) is not None)
    for dest, (_, default) in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
