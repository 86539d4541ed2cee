"""Pipeline partition: exact search vs AReaL's O(S * L^2) dynamic program, and real models.

Part 1 times :func:`areal_fn.pipeline.partition.partition_pipeline` with
``allow_empty_ends=True`` against AReaL's own dynamic program on AReaL's own problem:
the first and the last stage may hold no decoder layer (only the embedding, only the
output layer), inner stages may not, the embedding weighs on stage 0 and the output
layer on the last. The baseline is AReaL's algorithm restated in
:mod:`bench.areal_pipeline` (plain Python, as AReaL ships it), and the same dynamic
program vectorised with numpy (same O(S * L^2) work, a harder baseline). All three must
report the same bottleneck; costs are integers held in floats so every sum is exact.

Part 2 draws small random problems with a heavy embedding or output layer and counts
how often the closed-ends optimum (every chunk holds a layer, the default) is worse
than AReaL's bottleneck, and checks that ``allow_empty_ends=True`` always matches it.

Part 3 compares, for real models, the largest chunk load and the largest physical-rank
load of four splits: even layer counts, AReaL as shipped (its dynamic program on its own
parameter estimate), AReaL's dynamic program on the same cost model (balances the
``pp * vpp`` chunks as one chain, blind to ranks), and ours (same problem as AReaL's,
empty ends allowed).

Run: ``.venv/bin/python -m bench pipeline`` (``python -m bench.bench_pipeline --svg PATH``
writes the chart).
"""

import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.pipeline.costs import CostModel, LayerCosts, flop_costs, memory_costs
from areal_fn.pipeline.partition import Objective, StagePlan, partition_pipeline, split_evenly
from bench.areal_pipeline import (
    AREAL_SOURCE,
    areal_dp_numpy,
    areal_loads,
    areal_parameter_buckets,
    areal_stage_layer_lengths,
)

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- timing


def _time(fn: Callable[[], object], budget: float = 0.3) -> float:
    """Best wall time of ``fn`` over repeats filling about ``budget`` seconds."""
    best, spent = math.inf, 0.0
    while spent < budget or best == math.inf:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if dt > budget:
            break
    return best


def synthetic_costs(n: int, seed: int = 0) -> tuple[list[float], float, float]:
    """Integer layer costs in floats: dense layers ~1e8, every other layer an MoE ~3e8."""
    rng = np.random.default_rng(seed)
    base = rng.integers(80_000_000, 120_000_000, size=n)
    costs = [float(c * (3 if i % 2 == 0 else 1)) for i, c in enumerate(base)]
    return costs, 3.0e8, 3.5e8


@attrs.frozen(kw_only=True)
class Timing:
    """One benchmark case: the bottleneck found and the seconds each method took."""

    layers: int
    stages: int
    bottleneck: float
    ours_s: float
    numpy_s: float
    numpy_equal: bool
    python_s: float | None = None  # None: not run (too slow)
    python_equal: bool | None = None


def bench_partition() -> list[Timing]:
    rows = []
    for n in (94, 1000, 10000):
        for s in (8, 64):
            costs, fe, le = synthetic_costs(n)
            call = functools.partial(
                partition_pipeline, costs, s, first_extra=fe, last_extra=le, allow_empty_ends=True
            )
            plan = call()
            ours = _time(call)
            python_s = python_equal = None
            if n <= 1000:
                t = time.perf_counter()
                lengths = areal_stage_layer_lengths(costs, fe, le, s)
                python_s = time.perf_counter() - t
                python_equal = max(areal_loads(costs, fe, le, lengths)) == plan.max_load
            t = time.perf_counter()
            b_np, _ = areal_dp_numpy(costs, s, fe, le)
            numpy_s = time.perf_counter() - t
            rows.append(
                Timing(
                    layers=n,
                    stages=s,
                    bottleneck=plan.max_load,
                    ours_s=ours,
                    numpy_s=numpy_s,
                    numpy_equal=b_np == plan.max_load,
                    python_s=python_s,
                    python_equal=python_equal,
                )
            )
    return rows


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def print_partition(rows: list[Timing]) -> None:
    print("## exact partition vs AReaL's O(S*L^2) dynamic program (same process, same problem)")
    print()
    print(f"Baseline: AReaL's algorithm, {AREAL_SOURCE}; ours: allow_empty_ends=True.")
    print()
    print("| L | S | bottleneck | equal | ours | AReaL DP, Python | ratio | DP, numpy | ratio |")
    print("|---:|---:|---:|:---:|---:|---:|---:|---:|---:|")
    measured = {(r.layers, r.stages): r.python_s for r in rows if r.python_s is not None}
    for r in rows:
        equal = r.numpy_equal and r.python_equal is not False
        if r.python_s is not None:
            py = f"{_fmt_s(r.python_s)} | {r.python_s / r.ours_s:,.0f}x"
        else:  # the Python DP is O(S L^2): extrapolate from the largest measured L
            base = max(n for n, s in measured if s == r.stages)
            est = measured[(base, r.stages)] * (r.layers / base) ** 2
            py = f"~{_fmt_s(est)} (L^2 extrapolation, not run) | ~{est / r.ours_s:,.0f}x"
        print(
            f"| {r.layers} | {r.stages} | {r.bottleneck:.6g} | {'yes' if equal else 'NO'} "
            f"| {_fmt_s(r.ours_s)} | {py} | {_fmt_s(r.numpy_s)} | {r.numpy_s / r.ours_s:,.0f}x |"
        )
    print()


# ----------------------------------------------------------------------------- small cases


@attrs.frozen(kw_only=True)
class SmallCases:
    """Random small problems: how the closed-ends optimum and ours compare with AReaL."""

    cases: int
    closed_worse: int  # closed-ends optimum above AReaL's bottleneck
    open_equal: int  # allow_empty_ends=True: the same bottleneck as AReaL
    empty_end_used: int  # AReaL's split leaves the first or the last stage empty


def small_cases(cases: int = 1000, seed: int = 0) -> SmallCases:
    """``L`` in 4..12, ``K`` in 2..min(L, 6), layer costs 1..20 (mean 10.5); the
    embedding and the output layer are each, with even odds, heavy (10..40) or light
    (0..10)."""
    rng = random.Random(seed)
    worse = equal = empty = 0
    for _ in range(cases):
        n = rng.randint(4, 12)
        k = rng.randint(2, min(n, 6))
        costs = [float(rng.randint(1, 20)) for _ in range(n)]
        fe = float(rng.randint(10, 40) if rng.random() < 0.5 else rng.randint(0, 10))
        le = float(rng.randint(10, 40) if rng.random() < 0.5 else rng.randint(0, 10))
        lengths = areal_stage_layer_lengths(costs, fe, le, k)
        areal = max(areal_loads(costs, fe, le, lengths))
        closed = partition_pipeline(costs, k, first_extra=fe, last_extra=le)
        ours = partition_pipeline(costs, k, first_extra=fe, last_extra=le, allow_empty_ends=True)
        worse += closed.max_load > areal
        equal += ours.max_load == areal
        empty += lengths[0] == 0 or lengths[-1] == 0
    return SmallCases(cases=cases, closed_worse=worse, open_equal=equal, empty_end_used=empty)


def print_small(r: SmallCases) -> None:
    print("## small random cases with a heavy embedding or output layer")
    print()
    print(
        "| cases | AReaL leaves an end empty | closed ends worse than AReaL | "
        "allow_empty_ends=True equal to AReaL |"
    )
    print("|---:|---:|---:|---:|")
    print(
        f"| {r.cases} | {r.empty_end_used} ({r.empty_end_used / r.cases:.0%}) "
        f"| {r.closed_worse} ({r.closed_worse / r.cases:.0%}) "
        f"| {r.open_equal} ({r.open_equal / r.cases:.0%}) |"
    )
    print()


# ----------------------------------------------------------------------------- real models

#: (model, pp, vpp, Megatron moe_layer_freq or None). The last row is a hypothetical
#: configuration: Qwen3-30B-A3B built by Megatron with ``moe_layer_freq=2`` (MoE on layers
#: 0, 2, 4, ...), which AReaL's cost model reads as layers 1, 3, 5, ...
MODELS: tuple[tuple[str, int, int, int | None], ...] = (
    ("Qwen3-235B-A22B", 8, 2, None),
    ("Llama-3.1-405B", 16, 2, None),
    ("Qwen2.5-72B", 8, 1, None),
    ("Qwen3-30B-A3B", 4, 2, 2),
)
SEQ_LEN = 4096

COST_MODELS: tuple[tuple[str, CostModel], ...] = (
    ("FLOPs, seq 4096, micro-batch 1", functools.partial(flop_costs, seq_len=SEQ_LEN)),
    (
        "memory: params x 18 B + activations of 1 micro-batch of 4096 tokens",
        functools.partial(memory_costs, micro_batch_size=1, seq_len=SEQ_LEN),
    ),
)

METHODS = ("even", "AReaL as shipped", "AReaL's DP, same cost", "ours")


def _given(costs: LayerCosts, s: int, v: int, lengths: Sequence[int]) -> StagePlan:
    return StagePlan(
        costs=costs.layers,
        num_stages=s,
        vpp=v,
        stage_lengths=tuple(lengths),
        first_extra=costs.embedding,
        last_extra=costs.head,
        objective=Objective.GIVEN,
        allow_empty_ends=True,
    )


def areal_lengths(name: str, spec: ModelSpec, k: int, moe_layer_freq: int | None) -> list[int]:
    """AReaL's split as shipped: its parameter estimate of the HF config (Megatron's
    ``moe_layer_freq``, default 1, read its way), then its dynamic program."""
    hf = json.loads((ROOT / "specs" / "models" / f"{name}.json").read_text())
    moe = (
        {}
        if not spec.num_experts
        else {
            "num_moe_experts": spec.num_experts,
            "moe_ffn_hidden_size": spec.moe_intermediate_size,
            "moe_layer_freq": moe_layer_freq or 1,
        }
    )
    weights, emb, out = areal_parameter_buckets(hf, **moe)  # type: ignore[arg-type]
    return areal_stage_layer_lengths(weights, emb, out, k)


def real_model_plans(
    name: str, spec: ModelSpec, s: int, v: int, freq: int | None, model: CostModel
) -> dict[str, StagePlan]:
    costs = model(spec) if freq is None else model(spec, moe_layer_freq=freq)  # type: ignore[call-arg]
    k = s * v
    same = areal_stage_layer_lengths(list(costs.layers), costs.embedding, costs.head, k)
    return {
        "even": split_evenly(
            costs.layers, s, vpp=v, first_extra=costs.embedding, last_extra=costs.head
        ),
        "AReaL as shipped": _given(costs, s, v, areal_lengths(name, spec, k, freq)),
        "AReaL's DP, same cost": _given(costs, s, v, same),
        "ours": partition_pipeline(
            costs.layers,
            s,
            vpp=v,
            first_extra=costs.embedding,
            last_extra=costs.head,
            allow_empty_ends=True,
        ),
    }


def real_model_rows() -> list[tuple[str, str, dict[str, StagePlan]]]:
    out = []
    for cost_name, model in COST_MODELS:
        for name, s, v, freq in MODELS:
            spec = model_from_hf_config(ROOT / "specs" / "models" / f"{name}.json")
            label = f"{name} pp{s}" + (f" vpp{v}" if v > 1 else "")
            if freq is not None:
                label += f" (moe_layer_freq={freq}, hypothetical)"
            out.append((cost_name, label, real_model_plans(name, spec, s, v, freq, model)))
    return out


def _lower_bounds(plan: StagePlan) -> tuple[float, float]:
    total = math.fsum((*plan.costs, plan.first_extra, plan.last_extra))
    return total / plan.num_chunks, total / plan.num_stages


def _bar(x: float, scale: float = 40.0) -> str:
    cells = max(0.0, (x - 1.0) * scale)
    full = int(cells)
    return ("█" * full + ("▌" if cells - full >= 0.5 else "")) or "▏"


def print_real(rows: list[tuple[str, str, dict[str, StagePlan]]]) -> None:
    print("## real models: largest chunk and physical-rank load, relative to the lower bound")
    print()
    print("Lower bounds: total / (pp * vpp) for a chunk, total / pp for a rank; 1.000 is perfect.")
    print("Bar: one block per 2.5% above the bound (largest rank load).")
    last = None
    for cost_name, label, plans in rows:
        if cost_name != last:
            print()
            print(f"### cost: {cost_name}")
            print()
            print("| model | split | max chunk | max rank | stage lengths | max rank, bar |")
            print("|---|---|---:|---:|---|---|")
            last = cost_name
        for method in METHODS:
            plan = plans[method]
            lb_chunk, lb_rank = _lower_bounds(plan)
            chunk, rank = plan.max_load / lb_chunk, plan.max_rank_load / lb_rank
            lengths = ",".join(map(str, plan.stage_lengths))
            print(f"| {label} | {method} | {chunk:.3f} | {rank:.3f} | {lengths} | {_bar(rank)} |")
    print()


# ----------------------------------------------------------------------------- picture

_COLORS = ("#9e9e9e", "#e6a23c", "#5b8ff9", "#2e7d32")


def _panel(
    out: list[str],
    x0: float,
    y0: float,
    w: float,
    h: float,
    title: str,
    groups: list[tuple[str, list[float]]],
) -> None:
    """One bar panel: groups of bars, one per method, values relative to 1.0."""
    left, plot_h = 44.0, h - 78.0
    vmax = max(max(v) for _, v in groups)
    hi = 1.0 + max(0.05, math.ceil((vmax - 1.0) * 20) / 20)
    step = 0.05 if hi - 1.0 <= 0.3 else 0.1
    base_y = y0 + 22 + plot_h

    def ypos(val: float) -> float:
        return base_y - (val - 1.0) / (hi - 1.0) * plot_h

    out.append(f'<text x="{x0 + left}" y="{y0 + 12}" font-size="13">{title}</text>')
    for t in range(round((hi - 1.0) / step) + 1):
        yy = ypos(1.0 + t * step)
        out.append(
            f'<line x1="{x0 + left}" y1="{yy:.1f}" x2="{x0 + w}" y2="{yy:.1f}" stroke="#e0e0e0"/>'
        )
        out.append(
            f'<text x="{x0 + left - 5}" y="{yy + 4:.1f}" text-anchor="end">{1.0 + t * step:.2f}</text>'
        )
    group_w = (w - left) / len(groups)
    bar_w = group_w / (len(METHODS) + 1)
    for g, (label, vals) in enumerate(groups):
        gx = x0 + left + g * group_w + bar_w / 2
        for m, val in enumerate(vals):
            x, yy = gx + m * bar_w, ypos(val)
            out.append(
                f'<rect x="{x:.1f}" y="{yy:.1f}" width="{bar_w * 0.9:.1f}" '
                f'height="{max(0.5, base_y - yy):.1f}" fill="{_COLORS[m]}"/>'
            )
            out.append(
                f'<text x="{x + bar_w * 0.45:.1f}" y="{yy - 3:.1f}" text-anchor="middle" '
                f'font-size="8">{val:.3f}</text>'
            )
        cx = gx + bar_w * len(METHODS) / 2
        for i, line in enumerate(label.split("\n")):
            out.append(
                f'<text x="{cx:.1f}" y="{base_y + 14 + 13 * i:.1f}" text-anchor="middle" '
                f'font-size="11">{line}</text>'
            )
    out.append(
        f'<line x1="{x0 + left}" y1="{base_y:.1f}" x2="{x0 + w}" y2="{base_y:.1f}" stroke="black"/>'
    )


def _short(label: str) -> str:
    name, _, rest = label.partition(" ")
    rest = rest.replace(" (moe_layer_freq=2, hypothetical)", "\nmoe_layer_freq=2*")
    return f"{name}\n{rest}"


def svg_chart(rows: list[tuple[str, str, dict[str, StagePlan]]]) -> str:
    """Grouped bars: largest chunk and rank load over their lower bounds, per cost model."""
    costs = list(dict.fromkeys(c for c, _, _ in rows))
    col_w, row_h, top = 560.0, 290.0, 62.0
    width, height = 2 * col_w + 30, top + len(costs) * row_h + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">Pipeline splits: '
        "largest load over its lower bound (1.00 = perfect; lower is better)</text>",
    ]
    for i, method in enumerate(METHODS):
        x = 60 + i * 240
        out.append(f'<rect x="{x}" y="34" width="12" height="12" fill="{_COLORS[i]}"/>')
        out.append(f'<text x="{x + 16}" y="44" font-size="12">{method}</text>')
    for r, cost in enumerate(costs):
        picked = [(label, plans) for c, label, plans in rows if c == cost]
        for col, metric in enumerate(("chunk", "physical rank")):
            groups = []
            for label, plans in picked:
                vals = []
                for m in METHODS:
                    plan = plans[m]
                    lb_chunk, lb_rank = _lower_bounds(plan)
                    vals.append(
                        plan.max_load / lb_chunk if col == 0 else plan.max_rank_load / lb_rank
                    )
                groups.append((_short(label), vals))
            title = f"largest {metric} load; cost: {cost.split(':')[0].split(',')[0]}"
            _panel(out, 10 + col * (col_w + 10), top + r * row_h, col_w, row_h - 12, title, groups)
    out.append(
        f'<text x="10" y="{height - 8:.0f}" font-size="10">* hypothetical: Qwen3-30B-A3B as '
        "Megatron builds it with moe_layer_freq=2 (MoE on layers 0, 2, 4, ...). Costs: FLOPs "
        "and memory of one micro-batch of 4096 tokens (see docs/pipeline.md).</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def run() -> None:
    """Print the benchmark tables (markdown)."""
    print_partition(bench_partition())
    print_small(small_cases())
    print_real(real_model_rows())


if __name__ == "__main__":
    if "--svg" in sys.argv:
        target = Path(sys.argv[sys.argv.index("--svg") + 1])
        target.write_text(svg_chart(real_model_rows()), encoding="utf-8")
        print(f"wrote {target}")
    else:
        run()
