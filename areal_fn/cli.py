"""The ``areal-fn`` command: plan, convert, checkpoint inspect, demo.

Bad input prints one line (``areal-fn: error: ...``) and exits 2; no traceback.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.demo import DEMO_CONFIG as DEMO_CONFIG
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.runtime.console import text_console as text_console
from areal_fn.sharding.mesh import Axis
from areal_fn.strategy.allocation import Component
from areal_fn.strategy.parse import parse_allocation

if TYPE_CHECKING:
    pass


def _model(arg: str) -> ModelSpec:
    """A config path, a directory holding one, or an embedded name (``areal-fn models``):
    the one resolver :func:`~areal_fn.model.spec.model_from_hf_config` uses."""
    return model_from_hf_config(arg)


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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _bytes_arg(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise SpecError(
            f"--device-memory {text!r} is not a size; write e.g. 80GB or 80GiB"
        ) from None
    if unit not in units or value <= 0:
        raise SpecError(f"--device-memory {text!r} is not a size; write e.g. 80GB or 80GiB")
    return int(value * units[unit])


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from areal_fn.model.tensor_spec import DTYPE_BYTES
    from areal_fn.plans.memory import PrecisionPolicy, estimate_memory
    from areal_fn.strategy.check import check_strategy

    console = text_console()
    model = _model(args.config)
    if args.suggest:
        return _suggest(console, model, args)
    if args.allocation is None:
        raise SpecError(
            "plan needs an ALLOCATION (e.g. 'megatron:d2p2t2'), or --suggest N to rank strategies"
        )
    alloc = parse_allocation(args.allocation)
    check_strategy(model, alloc)
    console.print(
        Text.assemble(
            (model.model_type, "bold"),
            f" {model.num_layers} layers, {model.num_params:,} parameters; allocation ",
            (str(alloc), "bold"),
            f" on {alloc.world_size} ranks",
        )
    )
    for comp in alloc.components:
        layout = layout_for(model, comp)
        rr = alloc.rank_range(comp)
        console.print(
            Text.assemble(
                "\n",
                (comp.label, "bold"),
                f" {comp} ranks {rr.start}..{rr.stop - 1}: meshes ",
                ", ".join(str(m) for m in layout.meshes),
            )
        )
        if comp.is_training:
            console.print(str(estimate_memory(layout, PrecisionPolicy.bf16_mixed())))
        else:
            table = Table(title=f"{comp.label}: weights per rank ({model.dtype})")
            for col in ("rank", "tensors", "elements", "bytes"):
                table.add_column(col, justify="right")
            shown = (
                range(layout.world_size)
                if layout.world_size <= args.max_ranks
                else [0, layout.world_size // 2, layout.world_size - 1]
            )
            for r in shown:
                lts = layout.local_tensors(r)
                numel = sum(t.numel for t in lts)
                table.add_row(
                    str(rr.start + r),
                    str(len(lts)),
                    f"{numel:,}",
                    _human(numel * DTYPE_BYTES[model.dtype]),
                )
            console.print(table)
        if layout.stages is not None:
            from areal_fn.pipeline.partition import megatron_layout_string

            console.print(f"pipeline: {megatron_layout_string(layout.stages)}")
        if args.tensors:
            t2 = Table(title=f"{comp.label}: placements")
            for col in ("tensor", "shape", "placements", "present"):
                t2.add_column(col, overflow="fold")
            for t in layout.tensors[: args.tensors]:
                t2.add_row(
                    t.name,
                    str(t.shape),
                    str(t.sharding),
                    ",".join(f"{a}={c}" for a, c in t.present),
                )
            console.print(t2)
        if args.png:
            _pictures(console, model, comp, layout, Path(args.png))
    return 0


def _pictures(console: "Any", model: ModelSpec, comp: Component, layout: Layout, out: Path) -> None:
    from areal_fn.model.tensor_spec import DTYPE_BYTES
    from areal_fn.runtime.pictures import bar_chart_png, rank_grid_png, write

    mesh = layout.meshes[0]
    rows = mesh.sizes[0]
    cols = mesh.size // rows
    stage_axis = Axis.PP if Axis.PP in mesh.names else None
    stage_of = [
        mesh.coords(r)[mesh.axis_index(stage_axis)] if stage_axis else 0
        for r in range(layout.world_size)
    ]
    bytes_of = [
        sum(t.numel for t in layout.local_tensors(r)) * DTYPE_BYTES[model.dtype]
        for r in range(layout.world_size)
    ]
    name = str(comp).replace(":", "-").replace("|", "_").replace("(", "").replace(")", "")
    paths = [write(out / f"{name}.ranks.png", rank_grid_png(rows, cols, stage_of, bytes_of))]
    if layout.stages is not None:
        from areal_fn.pipeline.costs import param_costs
        from areal_fn.pipeline.partition import StagePlan

        lengths = layout.stages.stage_lengths
        costs = param_costs(model)
        plan = StagePlan(
            costs=costs.layers,
            num_stages=comp.dims.pp,
            vpp=comp.dims.vpp,
            stage_lengths=lengths,
            first_extra=costs.embedding,
            last_extra=costs.head,
        )
        paths.append(write(out / f"{name}.stages.png", bar_chart_png(plan.chunk_loads)))
    console.print("pictures: " + ", ".join(str(p) for p in paths))


def _suggest(console: "Any", model: ModelSpec, args: argparse.Namespace) -> int:
    from rich.table import Table

    from areal_fn.plans.advisor import suggest_strategy

    if args.device_memory is None:
        raise SpecError("--suggest needs --device-memory (e.g. 80GB)")
    found = suggest_strategy(model, args.suggest, _bytes_arg(args.device_memory), top=args.top)
    table = Table(
        title=f"strategies for {model.model_type} ({model.num_params:,} parameters) on {args.suggest} devices of {args.device_memory}"
    )
    for col in ("#", "allocation", "peak memory", "score (s/step)"):
        table.add_column(col)
    for i, sgn in enumerate(found, 1):
        table.add_row(str(i), sgn.allocation, _human(sgn.memory.max_rank.total), f"{sgn.score:.3g}")
    console.print(table)
    for i, sgn in enumerate(found, 1):
        console.print(f"{i}. {sgn.why}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from areal_fn.runtime.hf.convert import convert_back, convert_to_local

    console = text_console()
    if args.to_hf:
        summary = convert_back(args.src, args.allocation, args.dst, overwrite=args.overwrite)
    else:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("converting", total=None)
            summary = convert_to_local(
                args.src,
                args.allocation,
                args.dst,
                ranks=None if args.rank is None else [args.rank],
                overwrite=args.overwrite,
                progress=lambda _name: progress.advance(task),
            )
    console.print(f"converted {summary}")  # the summary says how long it took
    return 0


def _checkpoint_key() -> bytes | None:
    """The checkpoint key from ``AREAL_FN_CHECKPOINT_KEY`` (its UTF-8 bytes), None when unset."""
    import os

    from areal_fn.plans.checkpoint_keyed import KEY_ENV, MIN_KEY_BYTES

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

    args.hmac_key = _checkpoint_key()
    return run(args)


def cmd_checkpoint_export_hf(args: argparse.Namespace) -> int:
    from areal_fn.runtime.checkpoint.api import cmd_checkpoint_export_hf as run

    args.hmac_key = _checkpoint_key()
    return run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from areal_fn.runtime.demo.driver import run_demo

    return run_demo(steps=args.steps, workdir=args.workdir)


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
        help="also check every file's sha256; with AREAL_FN_CHECKPOINT_KEY set, a keyed "
        "digest that matches then vouches for every file, not only the manifest",
    )
    insp.add_argument("--tensors", type=int, default=24, help="how many tensors to list")
    insp.set_defaults(func=cmd_checkpoint_inspect)
    exp = csub.add_parser("export-hf", help="write a checkpoint's parameters as an HF checkpoint")
    exp.add_argument("dir")
    exp.add_argument("dest")
    exp.add_argument("--overwrite", action="store_true")
    exp.add_argument(
        "--trust-pickle",
        action="store_true",
        help="read a checkpoint saved before its manifest located its entries, by unpickling "
        "its DCP .metadata; unpickling runs any code a file holds: only for checkpoints you "
        "saved or got from a source you trust",
    )
    exp.set_defaults(func=cmd_checkpoint_export_hf)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-fn",
        description="Plan, convert, checkpoint and run distributed LLM training layouts.",
    )
    sub = p.add_subparsers(dest="command", required=True)
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
        help="allocation string, e.g. 'megatron:d2p2t2' or 'sglang:d4t2+fsdp:d8'",
    )
    plan.add_argument(
        "--suggest", type=int, metavar="N", help="rank training strategies for N devices"
    )
    plan.add_argument("--device-memory", help="memory per device for --suggest, e.g. 80GB")
    plan.add_argument("--top", type=int, default=5, help="how many suggestions to show")
    plan.add_argument(
        "--png", metavar="DIR", help="write pictures (rank grid, stage loads) into DIR"
    )
    plan.add_argument(
        "--max-ranks",
        type=int,
        default=16,
        help="rows of the per-rank table before it is summarised",
    )
    plan.add_argument(
        "--tensors", type=int, default=0, help="also list the placements of the first N tensors"
    )
    plan.set_defaults(func=cmd_plan)
    conv = sub.add_parser(
        "convert", help="HF checkpoint -> per-rank state of a layout (safetensors per rank)"
    )
    conv.add_argument("src", help="HF checkpoint directory")
    conv.add_argument("allocation", help="e.g. megatron:t2p2")
    conv.add_argument("dst", help="output directory")
    conv.add_argument("--rank", type=int, default=None, help="convert only this rank")
    conv.add_argument("--overwrite", action="store_true")
    conv.add_argument(
        "--to-hf",
        action="store_true",
        help="reverse: per-rank files in SRC (written for ALLOCATION) -> HF checkpoint DST",
    )
    conv.set_defaults(func=cmd_convert)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (SpecError, OSError) as e:
        print(f"areal-fn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
