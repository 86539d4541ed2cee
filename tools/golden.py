"""Golden per-rank layouts: a readable text form of a layout, kept in ``specs/golden/``.

:func:`render_layout` is pure: a layout and the ranks to list in full give the text.
Every rank gets a one-line summary (local tensors, elements, bytes in the layout's
dtype); the listed ranks get every local tensor (name, local shape, dtype) and every
piece of it, ``canonical name[canonical box] -> [local box]`` (the canonical box left
out when it is the whole canonical tensor), with ``<padding>`` for pieces that have no
canonical source (Megatron's and the inference engines' padded vocabulary rows). Boxes
are half-open ``start:stop`` ranges per dim.

:func:`render_case` reads a case's config and renders it; :func:`main` regenerates the files
of :data:`CASES` (reading configs and writing files are the only effects here)::

    .venv/bin/python -m tools.golden specs/golden

``tests/laws/test_golden.py`` re-renders every case and diffs it against its file.
"""

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.sharding.box import Box
from areal_fn.strategy.allocation import Backend, Component
from areal_fn.strategy.parse import parse_allocation
from areal_fn.typecheck import beartype

__all__ = ["CASES", "GoldenCase", "golden_ranks", "layout_for", "main", "render_layout"]

REGENERATE = ".venv/bin/python -m tools.golden specs/golden"


@attrs.frozen(kw_only=True)
class GoldenCase:
    """One golden file: ``{stem}.txt`` holds ``model`` (a ``specs/models`` config name)
    laid out under ``allocation`` (one component)."""

    stem: str
    model: str
    allocation: str


CASES: tuple[GoldenCase, ...] = (
    GoldenCase(stem="Qwen2.5-7B.megatron-d2p2t2", model="Qwen2.5-7B", allocation="megatron:d2p2t2"),
    GoldenCase(
        stem="Qwen3-30B-A3B.megatron-attn-d2t2-ffn-e4",
        model="Qwen3-30B-A3B",
        allocation="megatron:(attn:d2t2|ffn:e4)",
    ),
    GoldenCase(stem="Llama-3.1-8B.fsdp-d2t4", model="Llama-3.1-8B", allocation="fsdp:d2t4"),
    GoldenCase(stem="Qwen2.5-7B.sglang-d2t4", model="Qwen2.5-7B", allocation="sglang:d2t4"),
)


@beartype
def layout_for(model: ModelSpec, component: Component) -> Layout:
    """The layout of ``model`` under one component, with each backend's defaults
    (Megatron: the even stage split; FSDP2: no HSDP, TP embeddings)."""
    if component.backend is Backend.MEGATRON:
        return megatron_layout(model, component.dims)
    if component.backend is Backend.FSDP:
        return fsdp2_layout(model, component.dims)
    return inference_layout(model, component.dims)


@beartype
def golden_ranks(world_size: int) -> tuple[int, ...]:
    """The ranks listed in full: the first, the middle (``world_size // 2``) and the last."""
    return tuple(sorted({0, world_size // 2, world_size - 1}))


def _box(box: Box) -> str:
    return "[" + ",".join(f"{lo}:{hi}" for lo, hi in box.ranges) + "]"


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


@beartype
def render_layout(layout: Layout, ranks: Sequence[int], *, title: str = "") -> str:
    """The text form of ``layout``: a summary line per rank, then ``ranks`` in full."""
    for r in ranks:
        if not 0 <= r < layout.world_size:
            raise SpecError(
                f"rank {r} is outside this {layout.kind} layout of {layout.world_size} ranks"
            )
    lines = []
    if title:
        lines.append(f"# {title}")
    lines.append(
        f"# kind {layout.kind}, {layout.world_size} ranks, {len(layout.tensors)} logical "
        f"tensors; ranks {', '.join(map(str, ranks))} listed in full"
    )
    lines.append(
        "# piece: canonical[canonical box] -> [local box]; boxes are start:stop per dim; a "
        "canonical name without a box is the whole tensor; <padding> has no canonical source"
    )
    lines.append("")
    lines.append("summary")
    whole = {c.name: Box.full(c.shape) for c in layout.canonical}
    listed = {}
    for r in range(layout.world_size):
        local = layout.local_tensors(r)
        if r in ranks:
            listed[r] = local
        numel = sum(t.numel for t in local)
        nbytes = sum(t.numel * DTYPE_BYTES[t.dtype] for t in local)
        lines.append(f"rank {r}: {len(local)} tensors, {numel:,} elements, {nbytes:,} bytes")
    for r in ranks:
        lines.append("")
        lines.append(f"rank {r}")
        for t in listed[r]:
            lines.append(f"  {t.name} {_shape(t.shape)} {t.dtype}")
            for p in t.pieces:
                if p.canonical is None or p.canonical_box is None:
                    lines.append(f"    <padding> -> {_box(p.local_box)}")
                else:
                    src = "" if whole[p.canonical] == p.canonical_box else _box(p.canonical_box)
                    lines.append(f"    {p.canonical}{src} -> {_box(p.local_box)}")
    return "\n".join(lines) + "\n"


def render_case(case: GoldenCase, models_dir: Path) -> str:
    """The golden text of ``case``, its model read from ``models_dir/{model}.json``."""
    model = model_from_hf_config(models_dir / f"{case.model}.json")
    allocation = parse_allocation(case.allocation)
    component = allocation.components[0]
    layout = layout_for(model, component)
    canonical = str(allocation)
    given = "" if canonical == case.allocation else f" (given as {case.allocation})"
    title = (
        f"{case.model} under {canonical}{given}; params "
        f"{math.fsum(t.numel for t in model.tensors) / 1e9:.3f}B; regenerate: {REGENERATE}"
    )
    return render_layout(layout, golden_ranks(layout.world_size), title=title)


def main(argv: Sequence[str] | None = None) -> int:
    """Write every golden file of :data:`CASES` into the given directory."""
    parser = argparse.ArgumentParser(prog="python -m tools.golden", description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write, e.g. specs/golden")
    parser.add_argument(
        "--models",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "specs" / "models",
        help="directory of config.json files named <model>.json",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        path = args.out / f"{case.stem}.txt"
        text = render_case(case, args.models)
        tmp = path.with_suffix(".txt.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        print(f"wrote {path} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
