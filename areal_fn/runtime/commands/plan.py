"""``areal-fn plan CONFIG ALLOCATION``: meshes, per-rank memory, placements, pictures.

A training component prints its :class:`~areal_fn.plans.memory.MemoryReport`; an
inference component its weights per rank and the KV cache of ``--batch`` sequences of
``--context-len`` tokens (:func:`~areal_fn.plans.memory.kv_cache.kv_cache`). With ``--json``
the same facts, every rank listed by its global rank, as one JSON document.
"""

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.advisor.census import CensusIndex, census_of
from areal_fn.plans.memory import MemoryReport, estimate_memory
from areal_fn.plans.memory.activations import ActivationModel
from areal_fn.plans.memory.kv_cache import KVCache, kv_cache
from areal_fn.plans.precision import engine_policy, named_policy, policy_json
from areal_fn.runtime.commands.output import emit_json, human, parse_size
from areal_fn.runtime.commands.plan_flags import check_plan_ranks
from areal_fn.runtime.commands.plan_precision import (
    check_float8_flag,
    float8_json,
    precision_lines,
    with_float8_of,
)
from areal_fn.runtime.commands.suggest import (
    lora_json,
    lora_line,
    lora_of,
    memory_margin_of,
    model_json,
    stored_line,
    usable_bytes,
)
from areal_fn.sharding.mesh import Axis
from areal_fn.strategy.allocation import Allocation, Backend, Component
from areal_fn.strategy.check import check_strategy
from areal_fn.strategy.parse import parse_allocation

__all__ = ["Pictures", "cmd_plan"]

#: ``pictures(model, component, layout, args, first_rank)``: writes the ``--png`` pictures
#: of one component, returns their paths.
Pictures = Callable[[ModelSpec, Component, Layout, Any, int], tuple[Path, ...]]

#: How many runs of ranks a "does not fit" line names before it counts the rest.
_RUNS_SHOWN = 8


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
    (``--micro-batch`` sequences of that many tokens, ``--recompute``); with
    ``--lora-rank`` those of LoRA training (a frozen base, trained adapters)."""
    from areal_fn.layouts.lora import adapter_layout
    from areal_fn.plans.memory.lora import estimate_lora_memory

    policy = engine_policy(named_policy(args.precision), comp.backend)
    kw: dict[str, Any] = {}
    if args.seq_len is not None:
        act = ActivationModel(
            micro_batch_size=args.micro_batch, seq_len=args.seq_len, recompute=args.recompute
        )
        kw = {"activation": act, "model": model, "dims": comp.dims}
    lora = lora_of(model, args)
    if lora is not None:
        return estimate_lora_memory(layout, adapter_layout(layout, model, lora), policy, **kw)
    return with_float8_of(model, comp, estimate_memory(layout, policy, **kw), args)


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


def _inference_rows(
    model: ModelSpec, layout: Layout, kv: KVCache, first: int
) -> list[dict[str, Any]]:
    """Every rank's weights, KV cache and their sum (the ``weights`` of ``--json``)."""
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
    return rows


def _kv_json(kv: KVCache) -> dict[str, Any]:
    return {
        "context_len": kv.context_len,
        "batch": kv.batch,
        "dtype": kv.dtype,
        "elements_per_token_layer": kv.elements_per_token_layer,
        "bytes_per_token_layer": kv.bytes_per_token_layer,
        "stage_layers": list(kv.stage_layers),
        "stage_sliding_layers": list(kv.stage_sliding or [0] * len(kv.stage_layers)),
        "sliding_window": kv.sliding_window,
        "stage_linear_layers": list(kv.stage_linear or [0] * len(kv.stage_layers)),
        "linear_state_elements": kv.linear_state_elements,
        "max_bytes": kv.max_bytes,
    }


@attrs.frozen(kw_only=True)
class _Device:
    """``--device-memory`` and ``--memory-margin``: what each rank may use."""

    text: str  # as given, e.g. 80GB
    nbytes: int
    margin: float

    @property
    def usable(self) -> int:
        return usable_bytes(self.nbytes, self.margin)


@attrs.frozen(kw_only=True)
class _Facts:
    """One component's plan: its layout, first global rank, and per-rank memory."""

    comp: Component
    layout: Layout
    first: int
    report: MemoryReport | None  # training components
    kv: KVCache | None  # inference components
    rows: tuple[dict[str, Any], ...]  # inference components: _inference_rows

    @property
    def totals(self) -> list[tuple[int, int]]:
        """(global rank, bytes) of every rank."""
        if self.report is not None:
            return [(self.first + r.rank, r.total) for r in self.report.rows]
        return [(r["rank"], r["total"]) for r in self.rows]


def _facts(model: ModelSpec, alloc: Allocation, comp: Component, args: Any) -> _Facts:
    layout = layout_for(model, comp)
    first = alloc.rank_range(comp).start
    if comp.is_training:
        report = _training_memory(model, comp, layout, args)
        return _Facts(comp=comp, layout=layout, first=first, report=report, kv=None, rows=())
    kv = kv_cache(model, comp, context_len=args.context_len, batch=args.batch)
    rows = tuple(_inference_rows(model, layout, kv, first))
    return _Facts(comp=comp, layout=layout, first=first, report=None, kv=kv, rows=rows)


def _runs(ranks: Sequence[int]) -> str:
    """``0-3, 8, 10-11``: sorted ranks as runs (the first few, then how many more)."""
    runs: list[tuple[int, int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:_RUNS_SHOWN]]
    rest = sum(b - a + 1 for a, b in runs[_RUNS_SHOWN:])
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


def _fit_json(facts: _Facts, device: _Device, args: Any) -> dict[str, Any]:
    totals = facts.totals
    peak_rank, peak = max(totals, key=lambda t: (t[1], -t[0]))
    over = [r for r, b in totals if b > device.usable]
    return {
        "device_memory_bytes": device.nbytes,
        "memory_margin": device.margin,
        "usable_bytes": device.usable,
        "fits": not over,
        "peak_rank": peak_rank,
        "peak_bytes": peak,
        "ranks_over": over,
        "activations_counted": facts.report is None or args.seq_len is not None,
    }


def _fit_line(label: str, fit: dict[str, Any], device: _Device) -> str:
    """One line: whether every rank of the component fits ``--device-memory``."""
    usable = (
        f"{fit['usable_bytes']:,} bytes ({human(fit['usable_bytes'])}) usable of "
        f"{device.text} per device after the {fit['memory_margin']:.0%} margin (--memory-margin)"
    )
    peak = f"peak {human(fit['peak_bytes'])} on rank {fit['peak_rank']}"
    unseen = "" if fit["activations_counted"] else "; activations not counted: pass --seq-len"
    over = fit["ranks_over"]
    if not over:
        return f"{label} fits: every rank within the {usable}; {peak}{unseen}"
    n = len(over)
    return (
        f"{label} does not fit: {n} rank{'s' if n > 1 else ''} ({_runs(over)}) need more than "
        f"the {usable}; {peak}{unseen}"
    )


def _etp_note(model: ModelSpec, comp: Component) -> str | None:
    """What a Megatron user should know of a MoE component's ``etp`` when the plain form
    gave it (``etp`` 1, AReaL's reading) and Megatron-Core's own default (``etp = tp``)
    differs; None when they agree."""
    dims = comp.dims
    if not model.is_moe or comp.backend is not Backend.MEGATRON or dims.etp != 1 or dims.tp == 1:
        return None
    head = (
        f"experts: etp=1, as AReaL reads the plain form {comp}; Megatron-Core's own default "
        f"is etp=tp={dims.tp}"
    )
    try:
        other = attrs.evolve(comp, dims=attrs.evolve(dims, etp=dims.tp))
        check_strategy(model, parse_allocation(str(other)))
    except SpecError as e:
        return f"{head}, which is refused here ({e})"
    return f"{head}: write {other} for that"


def _component_json(
    model: ModelSpec,
    alloc: Allocation,
    comp: Component,
    args: Any,
    device: _Device | None,
    pictures: Pictures | None,
) -> dict[str, Any]:
    from areal_fn.pipeline.partition import megatron_layout_string

    facts = _facts(model, alloc, comp, args)
    layout = facts.layout
    out: dict[str, Any] = {
        "label": comp.label,
        "allocation": str(comp),
        "backend": comp.backend.value,
        "first_rank": facts.first,
        "last_rank": facts.first + layout.world_size - 1,
        "layout": layout.kind.value,
        "meshes": [str(m) for m in layout.meshes],
        "pipeline": None
        if layout.stages is None
        else megatron_layout_string(layout.stages, mtp_layers=model.mtp_layers),
        "memory": None
        if facts.report is None
        else _memory_json(facts.report, facts.first)
        | {
            "lora": lora_json(model, lora_of(model, args)),
            "precision": {"name": args.precision} | policy_json(facts.report.policy),
            "float8": float8_json(model, comp, args),
        },
        "weights": None if facts.kv is None else list(facts.rows),
        "kv_cache": None if facts.kv is None else _kv_json(facts.kv),
        "fit": None if device is None else _fit_json(facts, device, args),
        "notes": [n for n in (_etp_note(model, comp),) if n is not None],
    }
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
    if args.png and pictures is not None:
        out["pictures"] = [str(p) for p in pictures(model, comp, layout, args, facts.first)]
    return out


def _print_inference(console: Any, model: ModelSpec, facts: _Facts, args: Any) -> None:
    from rich.table import Table

    kv, layout = facts.kv, facts.layout
    assert kv is not None  # an inference component's facts
    table = Table(
        title=f"{facts.comp.label}: weights per rank ({model.dtype}) and KV cache of "
        f"{kv.batch} x {kv.context_len} tokens per replica (--batch, --context-len)"
    )
    for col in ("rank", "tensors", "elements", "weights", "kv cache", "total"):
        table.add_column(col, justify="right", overflow="fold")
    shown = (
        range(layout.world_size)
        if layout.world_size <= args.max_ranks
        else [0, layout.world_size // 2, layout.world_size - 1]
    )
    for r in shown:
        row = facts.rows[r]
        table.add_row(
            str(row["rank"]),
            str(row["tensors"]),
            f"{row['elements']:,}",
            human(row["weight_bytes"]),
            human(row["kv_cache_bytes"]),
            human(row["total"]),
        )
    console.print(table)
    console.print(
        f"kv cache: {kv.bytes_per_token_layer:,} bytes per token and layer on a rank "
        f"({kv.elements_per_token_layer} {kv.dtype} elements), layers per stage "
        f"{list(kv.stage_layers)}"
        + (
            f" (sliding-window layers {list(kv.stage_sliding)}, keeping "
            f"{kv.window_tokens:,} tokens each)"
            if kv.stage_sliding
            else ""
        )
        + (
            f" (linear-attention layers {list(kv.stage_linear)}, a state of "
            f"{kv.linear_state_elements:,} elements per sequence each, no tokens)"
            if kv.stage_linear
            else ""
        )
        + "; page rounding and CUDA graph buffers not counted"
    )


def _print_component(
    console: Any,
    model: ModelSpec,
    alloc: Allocation,
    comp: Component,
    args: Any,
    device: _Device | None,
    pictures: Pictures | None,
) -> None:
    from rich.table import Table
    from rich.text import Text

    facts = _facts(model, alloc, comp, args)
    layout = facts.layout
    console.print(
        Text.assemble(
            "\n",
            (comp.label, "bold"),
            f" {comp} ranks {facts.first}..{facts.first + layout.world_size - 1}: meshes ",
            ", ".join(str(m) for m in layout.meshes),
        )
    )
    if (note := _etp_note(model, comp)) is not None:
        console.print(note, markup=False, highlight=False)
    if facts.report is not None:
        console.print(facts.report.table(first_rank=facts.first))  # global ranks
        for line in precision_lines(model, comp, facts.report, args):
            console.print(line, markup=False, highlight=False)
        if (lora := lora_of(model, args)) is not None:
            console.print(lora_line(model, lora), markup=False, highlight=False)
    else:
        _print_inference(console, model, facts, args)
    if layout.stages is not None:
        from areal_fn.pipeline.partition import megatron_layout_string

        pipeline = megatron_layout_string(layout.stages, mtp_layers=model.mtp_layers)
        console.print(f"pipeline: {pipeline}")
    if device is not None:
        console.print(_fit_line(comp.label, _fit_json(facts, device, args), device))
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
        paths = pictures(model, comp, layout, args, facts.first)
        console.print("pictures: " + ", ".join(str(p) for p in paths))


def _check_inference_flags(alloc: Allocation, args: argparse.Namespace) -> None:
    """``--context-len``, ``--batch`` and ``--max-ranks`` need an inference component;
    ``--seq-len``, ``--micro-batch`` and ``--recompute`` a training one."""
    if not any(c.is_training for c in alloc.components):
        if args.lora_rank is not None:
            raise SpecError(
                f"--lora-rank counts the LoRA training of a training component (fsdp, "
                f"megatron); {alloc} has none: drop --lora-rank"
            )
        if "precision" in args.given:
            raise SpecError(
                f"--precision sets the policy of the training components (fsdp, megatron); "
                f"{alloc} has none: drop --precision (inference weights keep the config's dtype)"
            )
        given = [f for d, f in (("micro_batch", "--micro-batch"),) if d in args.given]
        given += ["--seq-len"] if args.seq_len is not None else []
        given += [("--recompute" if args.recompute else "--no-recompute")] * (
            "recompute" in args.given
        )
        if given:
            raise SpecError(
                f"{given[0]} shapes a training component's activations; {alloc} has none: "
                f"drop {given[0]} (--context-len and --batch size the KV cache of inference "
                "components)"
            )
    if any(not c.is_training for c in alloc.components):
        return
    for dest, flag in (
        ("context_len", "--context-len"),
        ("batch", "--batch"),
        ("max_ranks", "--max-ranks"),
    ):
        if dest in args.given:
            raise SpecError(
                f"{flag} applies to inference components (sglang, vllm); {alloc} has none: "
                f"drop {flag}"
            )


def cmd_plan(
    console: Any, model: ModelSpec, args: argparse.Namespace, *, pictures: Pictures | None = None
) -> int:
    """Print (or with ``args.json`` emit) the plan of ``args.allocation`` for ``model``;
    ``pictures`` writes the ``--png`` pictures of one component. With
    ``args.device_memory`` every rank's estimate is checked against it."""
    from rich.text import Text

    alloc = parse_allocation(args.allocation)
    check_plan_ranks(f"ALLOCATION {alloc} has", alloc.world_size)
    _check_inference_flags(alloc, args)
    check_float8_flag(model, alloc, args)
    if args.seq_len is not None and args.seq_len < 1:
        raise SpecError(f"--seq-len {args.seq_len} must be >= 1")
    device = None
    if args.device_memory is not None:
        device = _Device(
            text=args.device_memory,
            nbytes=parse_size(args.device_memory),
            margin=memory_margin_of(args),
        )
    check_strategy(model, alloc, seq_len=args.seq_len)
    if args.json:
        emit_json(
            {
                "schema": "areal-fn.plan/1",
                "model": model_json(model, args.config),
                "allocation": str(alloc),
                "world_size": alloc.world_size,
                "components": [
                    _component_json(model, alloc, c, args, device, pictures)
                    for c in alloc.components
                ],
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
    if (stored := stored_line(model, args.config)) is not None:
        console.print(stored, markup=False, highlight=False)
    for comp in alloc.components:
        _print_component(console, model, alloc, comp, args, device, pictures)
    return 0
