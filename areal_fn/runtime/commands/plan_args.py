"""The ``areal-fn plan`` command line: its flags, grouped by the form that takes them."""

import argparse
from collections.abc import Callable

from areal_fn.plans.memory.float8 import FLOAT8_RECIPES
from areal_fn.plans.precision import PRECISIONS
from areal_fn.runtime.commands.plan_flags import MAX_PLAN_RANKS

__all__ = ["add_plan_parser"]


def add_plan_parser(
    sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Callable[..., int]
) -> None:
    """``areal-fn plan CONFIG [ALLOCATION] [--suggest N ...]``."""
    plan = sub.add_parser(
        "plan", help="mesh, per-rank tensors and placements of a model under an allocation"
    )
    plan.add_argument(
        "config",
        help="HF config.json, a directory holding one, or an embedded model's name "
        "(any case, e.g. Qwen2.5-7B or qwen/qwen2.5-7b; 'areal-fn models' lists them)",
    )
    plan.add_argument(
        "allocation",
        nargs="?",
        help="allocation string, e.g. 'megatron:d2p2t2' or 'sglang:d4t2+fsdp:d8' (at most "
        f"{MAX_PLAN_RANKS} ranks)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON document (docs/cli.md)")
    plan.add_argument(
        "--mtp",
        action="store_true",
        help="hold the config's multi-token-prediction layers (num_nextn_predict_layers) as "
        "tensors: inference and megatron components carry them, fsdp refuses them",
    )
    plan.add_argument(
        "--tensors",
        type=int,
        default=None,
        help="also list the placements of the first N tensors (N >= 0)",
    )
    plan.add_argument(
        "--max-ranks",
        type=int,
        default=None,
        help="rows of an inference component's per-rank table before it is summarised (16; "
        "not with --json, which lists every rank)",
    )
    plan.add_argument(
        "--png",
        metavar="DIR",
        help="write pictures into DIR: a rank grid per component and, with pipeline "
        "stages, parameters per chunk (needs the pictures extra: "
        "pip install 'areal-fn[pictures]'); with --json their paths are listed per component",
    )
    kv = plan.add_argument_group("inference components: the KV cache budgeted per rank")
    kv.add_argument(
        "--context-len", type=int, default=None, help="tokens per sequence (default 4096)"
    )
    kv.add_argument(
        "--batch", type=int, default=None, help="sequences per engine replica (default 1)"
    )
    plan.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="count LoRA training of rank R in the training memory: the base frozen (its "
        "weights only), adapters on every attention projection and, in dense families, "
        "gate/up/down_proj trained; with an ALLOCATION it needs a training component",
    )
    _add_precision_arguments(plan)
    _add_suggest_arguments(plan)
    plan.set_defaults(func=handler)


def _add_precision_arguments(plan: argparse.ArgumentParser) -> None:
    """``--precision`` and ``--float8-recipe``: the training precision counted."""
    plan.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default=None,
        help="the training precision counted and printed (bf16): bf16 or fp16 parameters and "
        "compute with fp32 gradients, master weights and Adam states (fp16 with a dynamic "
        "loss scale; fsdp components keep fp32 sharded parameters, the optimizer's weights, "
        "and no master copy), or fp32 throughout; needs a training component",
    )
    plan.add_argument(
        "--float8-recipe",
        choices=FLOAT8_RECIPES,
        default=None,
        help="count torchao's float8 training of the fsdp components (Fsdp2RunOptions("
        "float8_recipe=...)): fp32 parameters, gradients and Adam states, and in buffers the "
        "FP8 copies of one linear layer at a time; refused where the engines refuse it "
        "(megatron, tp > 1, --lora-rank, a 16-bit --precision); with an ALLOCATION only",
    )


def _add_suggest_arguments(plan: argparse.ArgumentParser) -> None:
    """``plan --suggest N --device-memory SIZE`` and the assumptions it prints."""
    sg = plan.add_argument_group(
        "--suggest: rank training strategies (assumptions printed); a flag the form given "
        "(ALLOCATION or --suggest) does not use is refused"
    )
    sg.add_argument(
        "--suggest",
        type=int,
        metavar="N",
        help=f"rank training strategies for N devices (1 <= N <= {MAX_PLAN_RANKS}); not with "
        "an ALLOCATION",
    )
    sg.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory per device, with its unit: 80GB (80*10^9 bytes) or 80GiB (80*2^30); with "
        "an ALLOCATION: every rank's estimate is checked against it and the ranks that do not "
        "fit are listed",
    )
    sg.add_argument(
        "--top", type=int, default=None, help="how many suggestions to show (5); --suggest only"
    )
    sg.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (4096); with an allocation: rows of this many tokens are "
        "checked against its c and its training memory counts activations",
    )
    sg.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch (1); with an ALLOCATION it needs --seq-len",
    )
    sg.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (256); --suggest only",
    )
    sg.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="full activation recomputation (default: on); with an ALLOCATION it needs --seq-len",
    )
    _add_suggest_assumptions(sg)


def _add_suggest_assumptions(sg: "argparse._ArgumentGroup") -> None:
    """The flags that change what ``--suggest`` assumes of the cluster and the run."""
    sg.add_argument(
        "--gpus-per-node", type=int, default=None, help="devices per node (8); --suggest only"
    )
    sg.add_argument(
        "--optimizer-offload",
        action="store_true",
        default=None,
        help="optimizer master weights and states in host memory (default: on the device); "
        "--suggest only",
    )
    sg.add_argument(
        "--grad-dtype",
        default=None,
        metavar="DTYPE",
        help="gradients (Megatron's --main-grads-dtype): fp32, bf16 or fp16 (fp32); --suggest only",
    )
    sg.add_argument(
        "--master-dtype",
        default=None,
        metavar="DTYPE",
        help="optimizer master weights (Megatron's --main-params-dtype): fp32, bf16, fp16, or "
        "none for no master copy (fp32); --suggest only",
    )
    sg.add_argument(
        "--adam-dtype",
        default=None,
        metavar="DTYPE",
        help="Adam's two moments (Megatron's --exp-avg-dtype and --exp-avg-sq-dtype): fp32, "
        "bf16 or fp16 (fp32); --suggest only",
    )
    sg.add_argument(
        "--ep-dispatch",
        default=None,
        metavar="NAME",
        help="MoE token dispatcher the EP all-to-all is scored for: alltoall (Megatron's "
        "default: one copy per token and expert) or deepep (Megatron's flex dispatcher: one "
        "copy per destination node across nodes, fanned out over NVLink) (alltoall); "
        "--suggest only",
    )
    sg.add_argument(
        "--memory-margin",
        type=float,
        default=None,
        help="fraction of --device-memory kept free for what the estimate leaves out: CUDA "
        "context, communication buffers, fragmentation (0.1)",
    )
