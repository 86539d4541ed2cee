"""``areal-fn convert``: an HF checkpoint <-> per-rank files, with progress and ``--json``.

``convert SRC ALLOCATION DST`` writes the files of one component: an allocation of
several components (``sglang:t2+megatron:t2p2``) is refused unless ``--component``
names the one to write. ``convert SRC DST --to-hf`` reads the allocation the files
record (an ALLOCATION given must be the recorded one) and verifies every file's
checksum. The progress bar goes to stderr and stays there as a summary line.

``--format torch_dist`` writes Megatron-Core's own dist checkpoint instead of the
per-rank files (:mod:`~areal_fn.runtime.checkpoint.megatron_convert`); ``--to-hf``
reads either, telling them apart by what SRC holds.

``--to-hf`` of a LoRA adapter checkpoint (:mod:`~areal_fn.runtime.checkpoint.lora`)
writes its adapters as a PEFT adapter directory, or with ``--merge BASE`` merged into
the HF checkpoint ``BASE``.
"""

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from areal_fn.errors import ConversionError
from areal_fn.runtime.commands.output import emit_json
from areal_fn.runtime.console import text_console
from areal_fn.runtime.hf.convert import ConvertSummary
from areal_fn.strategy.parse import parse_allocation

__all__ = ["FORMATS", "choose_component", "cmd_convert"]

#: ``--format`` values: this library's per-rank files, Megatron-Core's dist checkpoint
FORMATS = ("rank-files", "torch_dist")


def choose_component(allocation: str, chosen: str | None) -> str:
    """The one component of ``allocation`` to write: its only one, or the one
    ``--component`` names (by label ``megatron[actor]``, name ``actor`` or backend)."""
    alloc = parse_allocation(allocation)
    comps = alloc.components
    listed = ", ".join(str(c) for c in comps)
    if chosen is None:
        if len(comps) == 1:
            return str(alloc)
        raise ConversionError(
            f"{alloc} has {len(comps)} components ({listed}) and convert writes the files of "
            f"one; pass --component {comps[-1].label} (or another), or give that component "
            f"alone ({comps[-1]})"
        )
    found = [c for c in comps if chosen in (c.label, c.name, c.backend.value)]
    if len(found) != 1:
        why = "none" if not found else f"{len(found)}"
        raise ConversionError(
            f"--component {chosen} matches {why} of the components of {alloc} ({listed}); pass "
            f"one of {', '.join(c.label for c in comps)} (name the components when two share "
            "a backend)"
        )
    return str(found[0])


def _json(
    summary: ConvertSummary,
    direction: str,
    src: str,
    allocation: str | None,
    fmt: str = "rank-files",
    torch_dist: dict[str, object] | None = None,
) -> None:
    emit_json(
        {
            "schema": "areal-fn.convert/1",
            "direction": direction,
            "format": fmt,
            "torch_dist": torch_dist,
            "src": src,
            "dst": summary.path,
            "allocation": allocation,
            "ranks": list(summary.ranks),
            "tensors": summary.tensors,
            "bytes": summary.bytes,
            "seconds": summary.seconds,
            "carried": list(summary.carried),
            "not_carried": list(summary.not_carried),
            "verified": list(summary.verified),
            "unverified": list(summary.unverified),
        }
    )


def _total_local(src: str, allocation: str, ranks: list[int] | None, mtp: bool) -> int:
    """Local tensors the conversion writes (the progress bar's total)."""
    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.hf.convert import layout_of

    layout, _ = layout_of(model_from_hf_config(src, mtp=mtp), allocation)
    chosen = range(layout.world_size) if ranks is None else ranks
    return sum(len(layout.local_tensors(r)) for r in chosen if 0 <= r < layout.world_size)


@contextlib.contextmanager
def _bar(description: str, total: int | None) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr, left as a summary line; removed when the work fails."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=text_console(stderr=True), transient=False) as progress:
        task = progress.add_task(description, total=total)
        try:
            yield lambda _name: progress.advance(task)
        except BaseException:
            progress.remove_task(task)
            progress.console.quiet = True  # the bar's own console: nothing more, no empty line
            raise


def _format(args: argparse.Namespace) -> str:
    """The format: ``--format``, else for ``--to-hf`` what SRC holds, else rank-files."""
    from areal_fn.runtime.checkpoint.megatron import is_megatron_checkpoint

    given = args.format
    if given is not None and given not in FORMATS:
        raise ConversionError(
            f"--format {given!r} is not a checkpoint format; use {FORMATS[0]} (this library's "
            f"per-rank files, the default) or {FORMATS[1]} (Megatron-Core's dist checkpoint)"
        )
    found = "torch_dist" if args.to_hf and is_megatron_checkpoint(args.src) else None
    if given == "rank-files" and found:
        raise ConversionError(
            f"{args.src} holds a Megatron-Core torch_dist checkpoint, not rank files; pass "
            "--format torch_dist or leave --format out"
        )
    fmt = given or found or "rank-files"
    if fmt == "torch_dist" and args.rank is not None:
        raise ConversionError(
            f"--rank {args.rank} with --format torch_dist: a torch_dist checkpoint is one "
            "checkpoint for every rank (Megatron-Core reads each rank's part); drop --rank"
        )
    if fmt != "torch_dist" and args.layer_spec is not None:
        raise ConversionError(
            "--layer-spec names the Megatron layer spec of a torch_dist checkpoint; it needs "
            "--format torch_dist"
        )
    _check_mtp_flags(args, fmt)
    _check_direction_flags(args, fmt)
    return fmt


def _check_direction_flags(args: argparse.Namespace, fmt: str) -> None:
    """Flags of one direction (or one format) given to the other: refused, never ignored."""
    flag = next((f for f in ("--trust-pickle", "--drop-optimizer") if _given(args, f)), None)
    if flag and not (args.to_hf and fmt == "torch_dist"):
        raise ConversionError(
            f"{flag} applies to --to-hf of a torch_dist SRC; "
            + ("rank files need" if args.to_hf else "reading an HF checkpoint needs")
            + " neither --trust-pickle nor --drop-optimizer: drop it"
        )
    if args.to_hf and args.rank is not None:
        raise ConversionError(
            f"--rank {args.rank} with --to-hf: --to-hf reads every rank's file to write the "
            "whole HF checkpoint; drop --rank"
        )
    if args.to_hf and args.layer_spec is not None:
        raise ConversionError(
            f"--layer-spec {args.layer_spec} with --to-hf: the key names are read from the "
            "torch_dist checkpoint itself; --layer-spec applies to writing one: drop it"
        )
    if not args.to_hf and args.model is not None:
        raise ConversionError(
            f"--model {args.model} applies to --to-hf (the model of rank files without a "
            "config.json); converting an HF checkpoint reads its own config.json: drop --model"
        )
    if args.fp8 is not None and not (args.to_hf and fmt == "rank-files"):
        raise ConversionError(
            f"--fp8 {args.fp8} writes the HF checkpoint of --to-hf from rank files as block "
            "FP8; "
            + (
                "a torch_dist SRC is written unquantised: convert it to HF, then to rank files"
                if args.to_hf
                else "reading an HF checkpoint reads its FP8 weights as they are: drop it"
            )
        )
    if args.component is not None and args.allocation is None:
        raise ConversionError(
            f"--component {args.component} picks a component of the ALLOCATION given, and "
            "none was: pass the ALLOCATION, or drop --component"
        )


def _given(args: argparse.Namespace, flag: str) -> bool:
    return bool(getattr(args, flag[2:].replace("-", "_")))


def _torch_dist(args: argparse.Namespace, fmt: str) -> int:
    """``convert`` in either direction with a Megatron-Core torch_dist checkpoint."""
    from areal_fn.runtime.checkpoint.megatron_convert import (
        convert_to_torch_dist,
        convert_torch_dist_to_hf,
    )
    from areal_fn.runtime.checkpoint.megatron_keys import mcore_layout

    src, dst = args.src, args.dst
    options: dict[str, object] | None = None
    if args.to_hf:
        if args.allocation is not None:
            raise ConversionError(
                f"a torch_dist checkpoint is not tied to an allocation (Megatron-Core loads it "
                f"under any strategy); drop {args.allocation}"
            )
        model = None if args.model is None else _model(args.model)
        with _bar("to HF", _total_hf(src, args.model)) as tick:
            summary = convert_torch_dist_to_hf(
                src,
                dst,
                model=model,
                trust_pickle=args.trust_pickle,
                drop_optimizer=args.drop_optimizer,
                overwrite=args.overwrite,
                progress=tick,
            )
        recorded = None
    else:
        recorded = _allocation(args)
        total = len(mcore_layout(_model(src)).local_tensors(0))
        with _bar("to torch_dist", total) as tick:
            summary, options = convert_to_torch_dist(
                src,
                recorded,
                dst,
                layer_spec=args.layer_spec or "te",
                overwrite=args.overwrite,
                progress=tick,
                drop_mtp=args.drop_mtp,
                text_only=args.text_only,
            )
    if args.json:
        _json(summary, "to-hf" if args.to_hf else "to-local", src, recorded, fmt, options)
    else:
        text_console().print(f"converted {summary}")
    return 0


def _check_mtp_flags(args: argparse.Namespace, fmt: str) -> None:
    """``--mtp`` and ``--drop-mtp``: one or the other, reading an HF checkpoint."""
    if args.mtp and args.drop_mtp:
        raise ConversionError(
            "--mtp carries the multi-token-prediction layers and --drop-mtp leaves them out; "
            "pass one of them"
        )
    if args.to_hf and (args.mtp or args.drop_mtp):
        raise ConversionError(
            "--mtp and --drop-mtp apply to reading an HF checkpoint; --to-hf writes the layers "
            "the files hold (rank files record their multi-token-prediction layers): drop them"
        )
    if args.to_hf and args.text_only:
        raise ConversionError(
            "--text-only applies to reading an HF checkpoint; --to-hf writes the tensors the "
            "files hold: drop --text-only"
        )
    if args.mtp and fmt == "torch_dist":
        raise ConversionError(
            "--mtp with --format torch_dist: the torch_dist writer does not write "
            "Megatron-Core's MTP block (nor the last stage's tied copy of the embedding); "
            "write rank files (leave out --format) or pass --drop-mtp to leave the layers out"
        )


def _allocation(args: argparse.Namespace) -> str:
    if args.allocation is None:
        raise ConversionError(
            "convert needs SRC ALLOCATION DST (e.g. areal-fn convert hf/ megatron:t2p2 "
            "out/); only --to-hf reads the allocation from the files"
        )
    return choose_component(args.allocation, args.component)


def _adapters(args: argparse.Namespace) -> int:
    """``convert CKPT DST --to-hf`` of a LoRA adapter checkpoint: PEFT's adapter directory,
    or with ``--merge BASE`` the adapters merged into the HF checkpoint ``BASE``."""
    from areal_fn.runtime.checkpoint.lora import export_merged, export_peft

    others = [f for f in ("--format", "--fp8", "--model") if _given(args, f)]
    others += ["--rank"] if args.rank is not None else []
    if others or args.allocation is not None:
        raise ConversionError(
            f"{args.src} is a LoRA adapter checkpoint; --to-hf writes its adapters (PEFT's "
            f"format, or merged with --merge BASE) and takes no "
            f"{others[0] if others else 'ALLOCATION'}: drop it"
        )
    if args.merge is None:
        out = export_peft(args.src, args.dst, overwrite=args.overwrite)
        what = "PEFT adapter (adapter_config.json, adapter_model.safetensors)"
    else:
        out = export_merged(args.src, args.merge, args.dst, overwrite=args.overwrite)
        what = f"HF checkpoint: {args.merge} with the adapters merged"
    if args.json:
        emit_json(
            {
                "schema": "areal-fn.convert/1",
                "direction": "to-peft" if args.merge is None else "to-merged",
                "src": args.src,
                "dst": str(out),
                "base": args.merge,
            }
        )
    else:
        text_console().print(f"wrote {out}: {what}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from areal_fn.runtime.checkpoint.lora import is_adapter_checkpoint
    from areal_fn.runtime.hf.convert import convert_back, convert_to_local

    if args.to_hf and is_adapter_checkpoint(args.src):
        return _adapters(args)
    if getattr(args, "merge", None) is not None:
        raise ConversionError(
            f"--merge BASE merges a LoRA adapter checkpoint; {args.src} is not one (or --to-hf "
            "is missing): pass an adapter checkpoint with --to-hf, or drop --merge"
        )
    fmt = _format(args)
    if fmt == "torch_dist":
        return _torch_dist(args, fmt)
    src, dst = args.src, args.dst
    if args.to_hf:
        alloc = (
            None if args.allocation is None else choose_component(args.allocation, args.component)
        )
        model = None if args.model is None else _model(args.model)
        with _bar("to HF", _total_hf(src, args.model)) as tick:
            summary = convert_back(
                src,
                alloc,
                dst,
                model=model,
                overwrite=args.overwrite,
                progress=tick,
                fp8=_fp8(args),
            )
        recorded = _recorded(src, alloc)
    else:
        recorded = _allocation(args)
        ranks = None if args.rank is None else [args.rank]
        with _bar("to per-rank files", _total_local(src, recorded, ranks, args.mtp)) as tick:
            summary = convert_to_local(
                src,
                recorded,
                dst,
                ranks=ranks,
                overwrite=args.overwrite,
                progress=tick,
                mtp=args.mtp,
                drop_mtp=args.drop_mtp,
                text_only=args.text_only,
            )
    if args.json:
        _json(summary, "to-hf" if args.to_hf else "to-local", src, recorded)
    else:
        text_console().print(f"converted {summary}")  # the summary says how long it took
    return 0


def _total_hf(src: str, model: str | None) -> int | None:
    """Canonical tensors of the model (the progress bar's total), None when unknown."""
    from areal_fn.errors import SpecError
    from areal_fn.model.spec import model_from_hf_config

    try:
        return len(model_from_hf_config(model or src).tensors)
    except (SpecError, OSError):
        return None  # convert_back says what is wrong


def _recorded(src: str, given: str | None) -> str | None:
    """``given``, or the allocation the rank files in ``src`` record (they agree: checked)."""
    from pathlib import Path

    from areal_fn.runtime.hf.convert import rank_file
    from areal_fn.runtime.hf.io import read_safetensors_header

    if given is not None:
        return given
    header, _, _ = read_safetensors_header(Path(src) / rank_file(0))
    return str((header.get("__metadata__") or {}).get("allocation")) or None


def _fp8(args: argparse.Namespace) -> Any:
    """The FP8 format ``--fp8 ROWSxCOLS`` asks for (None without it)."""
    from areal_fn.model.quantized import Fp8Format

    if args.fp8 is None:
        return None
    rows, x, cols = args.fp8.partition("x")
    if not (x and rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
        raise ConversionError(
            f"--fp8 {args.fp8!r} is not a block size; pass ROWSxCOLS, e.g. --fp8 128x128 "
            "(DeepSeek-V3's)"
        )
    return Fp8Format(block=(int(rows), int(cols)))


def _model(arg: str) -> Any:
    from areal_fn.model.spec import model_from_hf_config

    return model_from_hf_config(arg)
