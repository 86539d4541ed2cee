"""``areal-fn plan CONFIG ALLOCATION``: meshes, per-rank memory, placements, pictures.

A training component prints its :class:`~areal_fn.plans.memory.MemoryReport`; an
inference component its weights per rank and the KV cache of ``--batch`` sequences of
``--context-len`` tokens (:func:`~areal_fn.plans.kv_cache.kv_cache`). With ``--json``
the same facts, every rank listed by its global rank, as one JSON document.
"""

import argparse
from collections.abc import Callable
from typing import Any

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.activations import ActivationModel
from areal_fn.plans.census import CensusIndex, census_of
from areal_fn.plans.kv_cache import KVCache, kv_cache
from areal_fn.plans.memory import MemoryReport, PrecisionPolicy, estimate_memory
from areal_fn.runtime.commands.output import emit_json, human
from areal_fn.runtime.commands.suggest import model_json
from areal_fn.sharding.mesh import Axis
from areal_fn.strategy.allocation import Allocation, Component
from areal_fn.strategy.check import check_strategy
from areal_fn.strategy.parse import parse_allocation

__all__ = ["Pictures", "cmd_plan"]

#: ``pictures(console, model, component, layout, args, first_rank)``: the ``--png`` pictures.
Pictures = Callable[[Any, ModelSpec, Component, Layout, Any, int], None]


def _stage_of(layout: Layout) -> list[int]:
    """The pipeline stage of every rank of ``layout`` (0 without a ``pp`` axis)."""
    mesh = layout.meshes[0]
    if Axis.PP not in mesh.names:
        return [0] * layout.world_size
    return [mesh.coords(r)[mesh.axis_index(Axis.PP)] for r in range(layout.world_size)]


class _Weights:
    """Tensors and elements each rank of ``layout`` holds, computed once per distinct
    share (ranks that differ only along axes where every tensor is replicated hold the
    same), so a table of every rank costs the distinct shares, not the ranks."""

    def __init__(self, layout: Layout) -> None:
        self._index = CensusIndex(census_of(layout))
        self._seen: dict[tuple[tuple[int, ...], ...], tuple[int, int]] = {}

    def __call__(self, rank: int) -> tuple[int, int]:
        key = self._index.key(rank)
        if key not in self._seen:
            share = self._index.share(rank)
            self._seen[key] = (share.tensors, share.numel)
        return self._seen[key]


def _training_memory(
    model: ModelSpec, comp: Component, layout: Layout, args: argparse.Namespace
) -> MemoryReport:
    """Parameters, gradients and optimizer state; with ``--seq-len`` activations too
    (``--micro-batch`` sequences of that many tokens, ``--recompute``)."""
    policy = PrecisionPolicy.bf16_mixed()
    if args.seq_len is None:
        return estimate_memory(layout, policy)
    act = ActivationModel(
        micro_batch_size=args.micro_batch, seq_len=args.seq_len, recompute=args.recompute
    )
    return estimate_memory(layout, policy, activation=act, model=model, dims=comp.dims)


def _memory_json(report: MemoryReport, first: int) -> dict[str, Any]:
    m = report.max_rank
    return {
        "policy": str(report.policy),
        "activation": None if report.activation is None else str(report.activation),
        "optimizer_offload": report.optimizer_offload,
        "max_rank": first + m.rank,
        "max_total": m.total,
        "per_rank": [
            {
                "rank": first + r.rank,
                "params": r.params,
                "grads": r.grads,
                "optimizer": r.optimizer,
                "activations": r.activations,
                "buffers": r.buffers,
                "total": r.total,
            }
            for r in report.rows
        ],
    }


def _inference_json(
    model: ModelSpec, layout: Layout, kv: KVCache, first: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    stages = _stage_of(layout)
    weights = _Weights(layout)
    rows = []
    for r in range(layout.world_size):
        tensors, numel = weights(r)
        weight_bytes = numel * DTYPE_BYTES[model.dtype]
        cache = kv.stage_bytes(stages[r])
        rows.append(
            {
                "rank": first + r,
                "tensors": tensors,
                "elements": numel,
                "weight_bytes": weight_bytes,
                "kv_cache_bytes": cache,
                "total": weight_bytes + cache,
            }
        )
    summary: dict[str, Any] = {
        "context_len": kv.context_len,
        "batch": kv.batch,
        "dtype": kv.dtype,
        "elements_per_token_layer": kv.elements_per_token_layer,
        "bytes_per_token_layer": kv.bytes_per_token_layer,
        "stage_layers": list(kv.stage_layers),
        "max_bytes": kv.max_bytes,
    }
    return rows, summary


def _component_json(
    model: ModelSpec, alloc: Allocation, comp: Component, args: argparse.Namespace
) -> dict[str, Any]:
    from areal_fn.pipeline.partition import megatron_layout_string

    layout = layout_for(model, comp)
    rr = alloc.rank_range(comp)
    out: dict[str, Any] = {
        "label": comp.label,
        "allocation": str(comp),
        "backend": comp.backend.value,
        "first_rank": rr.start,
        "last_rank": rr.stop - 1,
        "layout": layout.kind.value,
        "meshes": [str(m) for m in layout.meshes],
        "pipeline": None
        if layout.stages is None
        else megatron_layout_string(layout.stages, mtp_layers=model.mtp_layers),
        "memory": None,
        "weights": None,
        "kv_cache": None,
    }
    if comp.is_training:
        out["memory"] = _memory_json(_training_memory(model, comp, layout, args), rr.start)
    else:
        kv = kv_cache(model, comp, context_len=args.context_len, batch=args.batch)
        out["weights"], out["kv_cache"] = _inference_json(model, layout, kv, rr.start)
    if args.tensors:
        out["tensors"] = [
            {
                "name": t.name,
                "shape": list(t.shape),
                "placements": str(t.sharding),
                "present": {str(a): c for a, c in t.present},
            }
            for t in layout.tensors[: args.tensors]
        ]
    return out


def _print_inference(
    console: Any, model: ModelSpec, comp: Component, layout: Layout, first: int, args: Any
) -> None:
    from rich.table import Table

    kv = kv_cache(model, comp, context_len=args.context_len, batch=args.batch)
    table = Table(
        title=f"{comp.label}: weights per rank ({model.dtype}) and KV cache of {kv.batch} x "
        f"{kv.context_len} tokens per replica (--batch, --context-len)"
    )
    for col in ("rank", "tensors", "elements", "weights", "kv cache", "total"):
        table.add_column(col, justify="right", overflow="fold")
    shown = (
        range(layout.world_size)
        if layout.world_size <= args.max_ranks
        else [0, layout.world_size // 2, layout.world_size - 1]
    )
    stages = _stage_of(layout)
    weights = _Weights(layout)
    for r in shown:
        tensors, numel = weights(r)
        wb = numel * DTYPE_BYTES[model.dtype]
        cache = kv.stage_bytes(stages[r])
        table.add_row(
            str(first + r), str(tensors), f"{numel:,}", human(wb), human(cache), human(wb + cache)
        )
    console.print(table)
    console.print(
        f"kv cache: {kv.bytes_per_token_layer:,} bytes per token and layer on a rank "
        f"({kv.elements_per_token_layer} {kv.dtype} elements), layers per stage "
        f"{list(kv.stage_layers)}; page rounding and CUDA graph buffers not counted"
    )


def _print_component(
    console: Any,
    model: ModelSpec,
    alloc: Allocation,
    comp: Component,
    args: Any,
    pictures: Pictures | None,
) -> None:
    from rich.table import Table
    from rich.text import Text

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
        console.print(str(_training_memory(model, comp, layout, args)))
    else:
        _print_inference(console, model, comp, layout, rr.start, args)
    if layout.stages is not None:
        from areal_fn.pipeline.partition import megatron_layout_string

        pipeline = megatron_layout_string(layout.stages, mtp_layers=model.mtp_layers)
        console.print(f"pipeline: {pipeline}")
    if args.tensors:
        t2 = Table(title=f"{comp.label}: placements")
        for col in ("tensor", "shape", "placements", "present"):
            t2.add_column(col, overflow="fold")
        for t in layout.tensors[: args.tensors]:
            t2.add_row(
                t.name, str(t.shape), str(t.sharding), ",".join(f"{a}={c}" for a, c in t.present)
            )
        console.print(t2)
    if args.png and pictures is not None:
        pictures(console, model, comp, layout, args, rr.start)


def cmd_plan(
    console: Any, model: ModelSpec, args: argparse.Namespace, *, pictures: Pictures | None = None
) -> int:
    """Print (or with ``args.json`` emit) the plan of ``args.allocation`` for ``model``;
    ``pictures`` writes the ``--png`` pictures of one component."""
    from rich.text import Text

    alloc = parse_allocation(args.allocation)
    if args.seq_len is not None and args.seq_len < 1:
        raise SpecError(f"--seq-len {args.seq_len} must be >= 1")
    check_strategy(model, alloc, seq_len=args.seq_len)
    if args.json:
        emit_json(
            {
                "schema": "areal-fn.plan/1",
                "model": model_json(model, args.config),
                "allocation": str(alloc),
                "world_size": alloc.world_size,
                "components": [_component_json(model, alloc, c, args) for c in alloc.components],
            }
        )
        return 0
    console.print(
        Text.assemble(
            (model.model_type, "bold"),
            f" {model.num_layers} layers"
            + (f" + {model.mtp_layers} multi-token-prediction" if model.mtp_layers else "")
            + f", {model.num_params:,} parameters; allocation ",
            (str(alloc), "bold"),
            f" on {alloc.world_size} ranks",
        )
    )
    for comp in alloc.components:
        _print_component(console, model, alloc, comp, args, pictures)
    return 0
