"""The ``areal-fn`` command: plan, convert, checkpoint inspect, demo.

Bad input prints one line (``areal-fn: error: ...``) and exits 2; no traceback.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for as layout_for
from areal_fn.model.demo import DEMO_CONFIG as DEMO_CONFIG
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.runtime.commands.plan_args import add_plan_parser
from areal_fn.runtime.commands.plan_flags import check_plan_flags
from areal_fn.runtime.console import text_console as text_console
from areal_fn.strategy.allocation import Component
from areal_fn.strategy.parse import parse_allocation as parse_allocation
from areal_fn.version import __version__

if TYPE_CHECKING:
    pass


def _model(arg: str, *, mtp: bool = False) -> ModelSpec:
    """A config path, a directory holding one, or an embedded name (``areal-fn models``):
    the one resolver :func:`~areal_fn.model.spec.model_from_hf_config` uses."""
    return model_from_hf_config(arg, mtp=mtp)


def cmd_models(args: argparse.Namespace) -> int:
    """One line per embedded config: name, model_type, parameters (active), shape."""
    from areal_fn.model.embedded import embedded_names

    rows = [
        ("name", "model_type", "parameters", "active", "layers", "hidden", "heads/kv", "experts")
    ]
    for name in embedded_names():
        m = model_from_hf_config(name)
        rows.append(
            (
                name,
                m.model_type,
                f"{m.num_params:,}",
                f"{m.num_active_params:,}" if m.is_moe else "-",
                str(m.num_layers),
                str(m.hidden_size),
                f"{m.num_attention_heads}/{m.num_key_value_heads}",
                f"{m.num_experts}x top-{m.num_experts_per_tok}" if m.is_moe else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from areal_fn.runtime.commands.plan import cmd_plan as run
    from areal_fn.runtime.commands.suggest import cmd_suggest

    check_plan_flags(args)
    if args.png:
        from areal_fn.runtime.commands.os_errors import prepare_png_dir

        _require_pictures()
        prepare_png_dir(args.png)
    console = text_console()
    model = _model(args.config, mtp=args.mtp)
    if args.mtp and not model.mtp_layers:
        raise SpecError(
            f"--mtp: {args.config} ({model.model_type}) declares no multi-token-prediction "
            f"layers (num_nextn_predict_layers); leave out --mtp"
        )
    if args.suggest is not None:
        return cmd_suggest(console, model, args)
    if args.allocation is None:
        raise SpecError(
            "plan needs an ALLOCATION (e.g. 'megatron:d2p2t2'), or --suggest N to rank strategies"
        )
    return run(console, model, args, pictures=_pictures)


def _pictures(
    model: ModelSpec,
    comp: Component,
    layout: Layout,
    args: argparse.Namespace,
    first_rank: int,
) -> tuple[Path, ...]:
    from areal_fn.runtime.pictures import plan_pictures

    return plan_pictures(args.config, model, comp, layout, Path(args.png), first_rank=first_rank)


def _require_pictures() -> None:
    """``--png`` without matplotlib: one line saying how to install the extra."""
    from areal_fn.runtime.pictures import require_matplotlib

    try:
        require_matplotlib()
    except ImportError as e:
        raise SpecError(f"--png: {e}") from None


def cmd_convert(args: argparse.Namespace) -> int:
    from areal_fn.runtime.commands.convert import cmd_convert as run

    return run(args)


def _checkpoint_key() -> bytes | None:
    """The checkpoint key from ``AREAL_FN_CHECKPOINT_KEY`` (its UTF-8 bytes), None when unset."""
    import os

    from areal_fn.plans.checkpoint.keyed import KEY_ENV, MIN_KEY_BYTES

    text = os.environ.get(KEY_ENV)
    if text is None:
        return None
    key = text.encode()
    if len(key) < MIN_KEY_BYTES:
        raise SpecError(
            f"{KEY_ENV} holds {len(key)} bytes; a checkpoint key needs at least {MIN_KEY_BYTES} "
            f"(e.g. export {KEY_ENV}=$(openssl rand -hex 32)), or unset it to open checkpoints "
            "without checking who saved them"
        )
    return key


def cmd_checkpoint_inspect(args: argparse.Namespace) -> int:
    from areal_fn.runtime.checkpoint.api import cmd_checkpoint_inspect as run
    from areal_fn.runtime.commands.inspect_json import cmd_inspect_json

    if args.tensors is not None and args.tensors < 0:
        raise SpecError(f"--tensors {args.tensors} must be >= 0: how many tensors to list")
    args.hmac_key = _checkpoint_key()
    if args.json:
        return cmd_inspect_json(args)
    if args.tensors is None:
        args.tensors = 24
    return run(args)


def cmd_checkpoint_export_hf(args: argparse.Namespace) -> int:
    from areal_fn.runtime.checkpoint.api import cmd_checkpoint_export_hf as run

    args.hmac_key = _checkpoint_key()
    return run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from areal_fn.runtime.demo.driver import run_demo

    return run_demo(steps=args.steps, workdir=args.workdir)


#: ``--overwrite`` of every command that writes a directory (docs/cli.md).
OVERWRITE_HELP = (
    "replace DST if it exists: the new output is written beside it and swapped in whole "
    "when complete, so no older file of the kind written (shards, rank files) survives; DST "
    "may hold only such files and those the new output holds, any other is refused by name "
    "and nothing is deleted (convert --rank: the rank's file joins the other ranks' files "
    "of the same conversion)"
)


def _add_checkpoint_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``areal-fn checkpoint inspect|export-hf``."""
    ckpt = sub.add_parser(
        "checkpoint",
        help="inspect or export canonical checkpoints (with AREAL_FN_CHECKPOINT_KEY set, "
        "each must carry a keyed digest made with that key)",
    )
    csub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    insp = csub.add_parser(
        "inspect", help="manifest, tensors, sizes and the strategy a checkpoint was saved with"
    )
    insp.add_argument("dir", help="a checkpoint directory, or a root holding 'latest'")
    insp.add_argument(
        "--verify",
        action="store_true",
        help="also check every file's checksum (BLAKE3; SHA-256 for older checkpoints); with AREAL_FN_CHECKPOINT_KEY set, a keyed "
        "digest that matches then vouches for every file, not only the manifest",
    )
    insp.add_argument(
        "--tensors", type=int, default=None, help="how many tensors to list (24; --json: all)"
    )
    insp.add_argument("--json", action="store_true", help="print one JSON document (docs/cli.md)")
    insp.set_defaults(func=cmd_checkpoint_inspect)
    exp = csub.add_parser("export-hf", help="write a checkpoint's parameters as an HF checkpoint")
    exp.add_argument(
        "dir", metavar="DIR", help="a checkpoint directory, or a root holding 'latest'"
    )
    exp.add_argument("dest", metavar="DST", help="output directory: the HF checkpoint")
    exp.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    exp.add_argument(
        "--trust-pickle",
        action="store_true",
        help="read a checkpoint saved before its manifest located its entries, by unpickling "
        "its DCP .metadata; unpickling runs any code a file holds: only for checkpoints you "
        "saved or got from a source you trust",
    )
    exp.set_defaults(func=cmd_checkpoint_export_hf)


def _add_convert_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``areal-fn convert SRC ALLOCATION DST`` and ``convert SRC [ALLOCATION] DST --to-hf``."""
    conv = sub.add_parser(
        "convert",
        help="HF checkpoint -> per-rank state of a layout (safetensors per rank), or a "
        "Megatron-Core torch_dist checkpoint (--format torch_dist)",
    )
    conv.add_argument(
        "src",
        help="HF checkpoint directory (with --to-hf: the per-rank files or a torch_dist checkpoint)",
    )
    conv.add_argument(
        "allocation",
        nargs="?",
        help="e.g. megatron:t2p2; with --to-hf optional: the files record it",
    )
    conv.add_argument("dst", metavar="DST", help="output directory")
    conv.add_argument(
        "--component",
        metavar="NAME",
        help="of an allocation with several components, the one to convert "
        "(label megatron[actor], name actor, or backend megatron)",
    )
    conv.add_argument("--rank", type=int, default=None, help="convert only this rank")
    conv.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    conv.add_argument(
        "--to-hf",
        action="store_true",
        help="reverse: per-rank files in SRC -> HF checkpoint DST (checksums verified)",
    )
    conv.add_argument(
        "--model",
        metavar="CONFIG",
        help="with --to-hf: the model's config (file, directory or embedded name) when SRC "
        "holds no config.json",
    )
    conv.add_argument(
        "--format",
        metavar="FORMAT",
        help="rank-files (default: one safetensors file per rank) or torch_dist (Megatron-Core's "
        "dist checkpoint, loaded by dist_checkpointing.load under any strategy); with --to-hf "
        "read from SRC",
    )
    conv.add_argument(
        "--layer-spec",
        choices=("te", "local"),
        default=None,
        help="--format torch_dist: key names of the Megatron layer spec that will load it "
        "(te: Transformer Engine, the default; local: Megatron-Core's local spec); they differ "
        "for MoE and multi-latent-attention layers only",
    )
    conv.add_argument(
        "--trust-pickle",
        action="store_true",
        help="--to-hf of a torch_dist checkpoint: unpickle its .metadata (it locates the "
        "tensors only there); unpickling runs any code a file holds: only for checkpoints you "
        "saved or got from a source you trust",
    )
    conv.add_argument(
        "--drop-optimizer",
        action="store_true",
        help="--to-hf of a torch_dist checkpoint holding optimizer state: convert the "
        "parameters alone (optimizer state is not carried)",
    )
    _add_mtp_flags(conv)
    _add_merge_flag(conv)
    _add_fp8_flag(conv)
    conv.add_argument("--json", action="store_true", help="print one JSON document (docs/cli.md)")
    conv.set_defaults(func=cmd_convert)


def _add_mtp_flags(conv: argparse.ArgumentParser) -> None:
    """``--mtp``, ``--drop-mtp`` and ``--text-only``: what to do with the tensors of an HF
    checkpoint that the model read does not hold."""
    conv.add_argument(
        "--mtp",
        action="store_true",
        help="rank files of an inference or megatron allocation: carry the checkpoint's "
        "multi-token-prediction layers (num_nextn_predict_layers); fsdp refuses them",
    )
    conv.add_argument(
        "--drop-mtp",
        action="store_true",
        help="leave out the checkpoint's multi-token-prediction layers (listed as not carried)",
    )
    conv.add_argument(
        "--text-only",
        action="store_true",
        help="a multimodal checkpoint (Qwen3.5), read as its text model: leave out its "
        "other tensors (vision encoder, mtp.*; listed as not carried)",
    )


def _add_merge_flag(conv: argparse.ArgumentParser) -> None:
    conv.add_argument(
        "--merge",
        metavar="BASE",
        help="--to-hf of a LoRA adapter checkpoint: merge its adapters into the HF checkpoint "
        "BASE (without: write them as a PEFT adapter directory)",
    )


def _add_fp8_flag(conv: argparse.ArgumentParser) -> None:
    conv.add_argument(
        "--fp8",
        metavar="ROWSxCOLS",
        default=None,
        help="--to-hf from rank files: write the decoder layers' Linear weights as block FP8 "
        "(float8_e4m3fn and one float32 weight_scale_inv per block, e.g. 128x128), with its "
        "quantization_config in config.json (docs/conversion.md)",
    )


#: What the library's messages say in Python, and what the command line says instead.
CLI_WORDS = (
    ("pass overwrite=True", "pass --overwrite"),
    ("; overwrite=True replaces", "; --overwrite replaces"),
    ("; ranks= writes some ranks", "; --rank writes one rank"),
    ("convert every rank (without ranks=)", "convert every rank (without --rank)"),
    ("trust_pickle=True (--trust-pickle on the command line)", "--trust-pickle"),
    ("trust_pickle=True (--trust-pickle)", "--trust-pickle"),
    ("(hmac_key=None; on the command line, unset", "(unset"),
    ("pass model= (a ModelSpec)", "pass --model CONFIG"),
    ("another model than model=; drop model= or", "another model than --model; drop --model or"),
    ("pass verify", "pass --verify"),
    ("pass trust_pickle=True only", "pass --trust-pickle only"),
    ("pass drop_optimizer=True", "pass --drop-optimizer"),
    (
        "so drop_optimizer=True has nothing to drop: pass drop_optimizer=False",
        "so --drop-optimizer has nothing to drop: drop --drop-optimizer",
    ),
    (
        "(model_from_hf_config(config), mtp=False, the default; on the command line leave out "
        "--mtp)",
        "(leave out --mtp)",
    ),
    ("model_from_hf_config(config, mtp=True)", "--mtp"),
    (
        "with drop_mtp=True (HfCheckpoint.check, convert_to_local, convert_to_torch_dist)",
        "with --drop-mtp",
    ),
    ("pass drop_mtp=True", "pass --drop-mtp"),
    (
        "pass text_only=True (HfCheckpoint.check, load_into, convert_to_local, "
        "convert_to_torch_dist)",
        "pass --text-only",
    ),
    ("drop text_only=True", "drop --text-only"),
    ("convert it with text_only=True to rank files", "convert it with --text-only to rank files"),
    ("text_only=True: ", "--text-only: "),
    ("drop drop_mtp=True", "drop --drop-mtp"),
    ("drop_mtp=True: ", "--drop-mtp: "),
    ("multi-token-prediction layers (drop_mtp=True)", "multi-token-prediction layers (--drop-mtp)"),
    (
        "a lighter policy (PrecisionPolicy.bf16_pure())",
        "bf16 state (--grad-dtype, --master-dtype, --adam-dtype)",
    ),
    (", recompute=True", ", --recompute"),
    ("a smaller micro-batch", "a smaller --micro-batch"),
    ("optimizer_offload=True", "--optimizer-offload"),
    ("LoRA (lora=LoraConfig(...))", "--lora-rank R"),
    ("a smaller LoRA rank", "a smaller --lora-rank"),
    ("ranks=[", "--rank ["),
)


def cli_words(message: str) -> str:
    """``message`` with the library's Python spellings replaced by the flags (CLI_WORDS)."""
    for python, flag in CLI_WORDS:
        message = message.replace(python, flag)
    return message


class _Parser(argparse.ArgumentParser):
    """A command's parser that takes flags between positionals (``plan CONFIG --json
    ALLOCATION``, ``convert SRC --overwrite ALLOCATION DST``): argparse's intermixed parse,
    for parsers without subcommands."""

    _inner = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        nested = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if self._inner or nested:
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-fn",
        description="Plan, convert, checkpoint and run distributed LLM training layouts.",
    )
    p.add_argument("--version", action="version", version=f"areal-fn {__version__}")
    p.add_argument(
        "--json",
        dest="global_json",
        action="store_true",
        help="print one JSON document: the same as the command's own --json (plan, convert, "
        "checkpoint inspect)",
    )
    sub: "argparse._SubParsersAction[argparse.ArgumentParser]" = p.add_subparsers(
        dest="command",
        required=True,
        parser_class=_Parser,  # type: ignore[arg-type]
    )
    add_plan_parser(sub, cmd_plan)
    _add_convert_parser(sub)
    _add_checkpoint_parser(sub)
    models = sub.add_parser(
        "models", help="list the embedded model configs (names usable wherever a config is)"
    )
    models.set_defaults(func=cmd_models)
    demo = sub.add_parser(
        "demo",
        help="the main job: train, checkpoint, reshard and sync a tiny model on CPU "
        "(4 processes under torchrun)",
    )
    demo.add_argument(
        "--steps", type=int, default=30, help="training steps under fsdp:d2t2 (at least 20)"
    )
    demo.add_argument(
        "--workdir",
        metavar="DIR",
        help="a new or empty directory for the checkpoint (DIR/checkpoints) and the HF "
        "export (DIR/hf); default: a new temporary directory, kept and printed",
    )
    demo.set_defaults(func=cmd_demo)
    return p


#: The commands' outputs a user names: (flag or argument, its ``args`` attribute).
_OUTPUTS = (("DST", "dst"), ("DST", "dest"), ("--png", "png"), ("--workdir", "workdir"))


def _outputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """The output paths given to this command, each with the flag that gave it."""
    return [(flag, Path(value)) for flag, dest in _OUTPUTS if (value := getattr(args, dest, None))]


def _command_words(args: argparse.Namespace) -> str:
    """``plan``, ``checkpoint inspect``: the command as typed."""
    sub = getattr(args, "checkpoint_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


def error_line(e: SpecError | OSError, args: argparse.Namespace, argv: Sequence[str]) -> str:
    """The one line a failed command prints after ``areal-fn: error: ``: the library's
    message in the command line's words (:func:`cli_words`), or an OS error naming the
    path the user gave (``argv``) rather than a temporary one beside it."""
    if isinstance(e, SpecError):
        return cli_words(str(e))
    from areal_fn.runtime.commands.os_errors import os_error_message

    return os_error_message(e, _outputs(args))


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(words)
    if args.global_json:
        if not hasattr(args, "json"):
            parser.error(
                f"--json: areal-fn {_command_words(args)} has no JSON output; drop --json "
                "(plan, convert and checkpoint inspect have one)"
            )
        args.json = True
    try:
        return int(args.func(args))
    except (SpecError, OSError) as e:
        print(f"areal-fn: error: {error_line(e, args, words)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
