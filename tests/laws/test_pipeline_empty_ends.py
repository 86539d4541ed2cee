"""Laws of ``partition_pipeline(allow_empty_ends=True)``: the first chunk may hold only
the embedding and the last only the head and loss (AReaL's problem); inner chunks never
empty. Optimality against brute force, agreement with AReaL's own dynamic program,
tiling and round trips of plans with empty ends, and the default Megatron split."""

import itertools
import math
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.layouts.megatron import megatron_layout, stages_for
from areal_fn.model.spec import model_from_hf_config
from areal_fn.pipeline.partition import (
    Objective,
    StagePlan,
    megatron_layout_string,
    module_names,
    partition_pipeline,
)
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.testing.pipeline import PipelineProblem, pipeline_problems, stage_plans
from bench.areal_pipeline import areal_dp_numpy, areal_loads, areal_stage_layer_lengths

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"


def compositions(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every ``(n_0, ..., n_{k-1})`` summing to ``n`` with ``n_0, n_{k-1} >= 0`` and the
    inner ones ``>= 1`` (with ``k == 1`` the one chunk holds all ``n``)."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for last in range(n - first + 1):
            inner = n - first - last
            if inner < k - 2 or (k == 2 and inner):
                continue
            for cuts in itertools.combinations(range(1, inner), k - 3) if k > 2 else [()]:
                b = (0, *cuts, inner)
                mid = tuple(b[j + 1] - b[j] for j in range(k - 2)) if k > 2 else ()
                yield (first, *mid, last)


def brute_force(
    p: PipelineProblem, *, balance_ranks: bool = True
) -> tuple[Fraction, Fraction, tuple[int, ...]]:
    """(optimal chunk bottleneck, best rank bottleneck among those, the tie-break
    winner's boundaries), exact, over every partition with possibly empty ends."""
    s, v, k = p.num_stages, p.vpp, p.num_chunks
    costs = [Fraction(c) for c in p.costs]
    fe, le = Fraction(p.first_extra), Fraction(p.last_extra)
    total = sum(costs) + fe + le
    best = None
    for lengths in compositions(len(costs), k):
        b = (0, *itertools.accumulate(lengths))
        chunks = [sum(costs[b[j] : b[j + 1]], Fraction(0)) for j in range(k)]
        chunks[0] += fe
        chunks[-1] += le
        ranks = [sum(chunks[j] for j in range(r, k, s)) for r in range(s)]

        def cut(j: int, b: tuple[int, ...] = b) -> tuple[Fraction, int]:
            before = fe + sum(costs[: b[j]], Fraction(0))  # chunk 0 always holds the embedding
            return abs(k * before - j * total), b[j]

        if v > 1 and balance_ranks:
            order = [cut(i * s + r) for r in range(s) for i in range(v) if 0 < i * s + r < k]
            key = (max(chunks), max(ranks), order)
        else:
            key = (max(chunks), Fraction(0), [cut(j) for j in range(1, k)])
        if best is None or key < best[0]:
            best = (key, b, max(ranks))
    assert best is not None
    (chunk, _, _), b, rank = best
    return chunk, rank, b


def plan_of(p: PipelineProblem, **kw: object) -> StagePlan:
    return partition_pipeline(
        p.costs,
        p.num_stages,
        vpp=p.vpp,
        first_extra=p.first_extra,
        last_extra=p.last_extra,
        allow_empty_ends=True,
        **kw,  # type: ignore[arg-type]
    )


def open_problems(**kw: int) -> st.SearchStrategy[PipelineProblem]:
    return pipeline_problems(allow_empty_ends=True, **kw)


# ----------------------------------------------------------------------------- optimality


def test_compositions_count_every_partition_once() -> None:
    # n layers, k chunks, ends open: choose k-1 cut points among the n+1 gaps of the
    # n + 2 items, C(n + 1, k - 1)
    for n in range(1, 7):
        for k in range(1, n + 3):
            got = list(compositions(n, k))
            assert len(got) == len(set(got)) == math.comb(n + 1, k - 1)
            assert all(sum(c) == n and all(x >= 1 for x in c[1:-1]) for c in got)


@given(open_problems(max_layers=8))
def test_optimum_and_tie_break_match_brute_force(p: PipelineProblem) -> None:
    plan = plan_of(p)
    chunk, rank, b = brute_force(p)
    assert plan.max_load == float(chunk)
    assert plan.boundaries == b
    assert plan.rank_optimal
    assert plan.max_rank_load == float(rank)
    assert plan.objective is (Objective.CHUNK_THEN_RANK if p.vpp > 1 else Objective.CHUNK)
    assert plan.allow_empty_ends


@given(open_problems(max_layers=8, max_stages=3, max_vpp=3))
def test_chunk_only_plan_matches_brute_force(p: PipelineProblem) -> None:
    plan = plan_of(p, balance_ranks=False)
    chunk, _, b = brute_force(p, balance_ranks=False)
    assert plan.max_load == float(chunk)
    assert plan.boundaries == b


@given(open_problems(max_layers=8, max_stages=3, max_vpp=3))
def test_local_search_keeps_bottleneck_and_never_loses_to_chunk_plan(p: PipelineProblem) -> None:
    plan = plan_of(p, rank_search_budget=0)
    chunk, rank, _ = brute_force(p)
    assert plan.max_load == float(chunk)
    assert float(rank) <= plan.max_rank_load <= plan_of(p, balance_ranks=False).max_rank_load


@given(pipeline_problems(max_layers=30, max_stages=4, max_vpp=3))
def test_open_ends_never_worse_than_closed_ends(p: PipelineProblem) -> None:
    closed = partition_pipeline(
        p.costs, p.num_stages, vpp=p.vpp, first_extra=p.first_extra, last_extra=p.last_extra
    )
    assert plan_of(p).max_load <= closed.max_load


def test_heavy_head_gets_a_stage_of_its_own() -> None:
    plan = partition_pipeline([1.0] * 6, 4, first_extra=2.0, last_extra=10.0, allow_empty_ends=True)
    assert plan.stage_lengths[-1] == 0 and plan.max_load == 10.0
    assert megatron_layout_string(plan).endswith("|L")
    closed = partition_pipeline([1.0] * 6, 4, first_extra=2.0, last_extra=10.0)
    assert closed.max_load == 11.0


# ----------------------------------------------------------------------------- AReaL's DP


@settings(max_examples=150)
@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=24),
    st.integers(2, 10),
    st.integers(0, 400),
    st.integers(0, 400),
)
def test_bottleneck_equals_areal_dynamic_program(
    costs: list[int], k: int, emb: int, head: int
) -> None:
    """AReaL's own problem and algorithm (restated in bench/areal_pipeline.py): integer
    costs held in floats, so its float sums are exact and the bottlenecks comparable."""
    k = min(k, len(costs) + 2)
    layers = [float(c) for c in costs]
    lengths = areal_stage_layer_lengths(layers, float(emb), float(head), k)
    areal = max(areal_loads(layers, float(emb), float(head), lengths))
    ours = partition_pipeline(
        layers, k if k > 1 else 1, first_extra=emb, last_extra=head, allow_empty_ends=True
    )
    assert ours.max_load == areal
    assert areal_dp_numpy(layers, k, float(emb), float(head))[0] == areal
    assert all(n >= 1 for n in lengths[1:-1])


# ----------------------------------------------------------------------------- plans


@given(stage_plans(allow_empty_ends=True))
def test_every_layer_is_in_exactly_one_chunk(plan: StagePlan) -> None:
    assert [i for j in range(plan.num_chunks) for i in plan.chunk_layers(j)] == list(
        range(plan.num_layers)
    )
    assert all(n >= 1 for n in plan.stage_lengths[1:-1])
    for layer in range(plan.num_layers):
        rank, vstage, local = plan.locate(layer)
        assert plan.chunk_layers(vstage * plan.num_stages + rank)[local] == layer
    total = math.fsum((*plan.costs, plan.first_extra, plan.last_extra))
    assert math.isclose(math.fsum(plan.chunk_loads), total, rel_tol=1e-12)
    assert math.isclose(math.fsum(plan.rank_loads), total, rel_tol=1e-12)


@given(stage_plans(allow_empty_ends=True))
def test_layout_string_and_module_names(plan: StagePlan) -> None:
    parts = megatron_layout_string(plan).split("|")
    assert len(parts) == plan.num_chunks
    assert parts[0].startswith("E") and parts[-1].endswith("L")
    for n, part in zip(plan.stage_lengths, parts, strict=True):
        body = part.removeprefix("E").removesuffix("L")
        assert body == ("" if n == 0 else "t" if n == 1 else f"t*{n}")
    names = module_names(plan)
    flat = [n for stage in names for n in stage]
    assert flat == [
        "tok_embeddings",
        *(f"layers.{i}" for i in range(plan.num_layers)),
        "norm",
        "output",
    ]
    assert names[0][0] == "tok_embeddings" and names[-1][-1] == "output"


@given(stage_plans(allow_empty_ends=True))
def test_repr_is_valid_python_and_str_has_a_row_per_chunk(plan: StagePlan) -> None:
    assert eval(repr(plan), {"StagePlan": StagePlan, "Objective": Objective}) == plan
    assert len(str(plan).splitlines()) == plan.num_chunks + 3


def test_empty_end_plan_plugs_into_megatron_layout() -> None:
    """The embedding stays on pp rank 0 and the head on the last rank when their chunks
    hold no decoder layer; every layer lands where ``plan.locate`` says."""
    spec = model_from_hf_config(SPECS / "Qwen2.5-0.5B.json")
    plan = StagePlan(
        costs=(1.0,) * spec.num_layers,
        num_stages=4,
        vpp=2,
        stage_lengths=(0, 4, 4, 4, 4, 4, 4, 0),
        allow_empty_ends=True,
    )
    layout = megatron_layout(spec, ParallelDims(pp=4, vpp=2), stages=plan)
    for rank in range(4):
        names = {t.name for t in layout.local_tensors(rank)}
        held = {
            (int(n.split(".")[0].removeprefix("model")), int(n.split(".")[3]))
            for n in names
            if ".decoder.layers." in n
        }
        assert held == {
            (v, local)
            for layer in range(spec.num_layers)
            for r, v, local in [plan.locate(layer)]
            if r == rank
        }
        assert ("model0.embedding.word_embeddings.weight" in names) == (rank == 0)
        assert ("model1.output_layer.weight" in names) == (rank == 3)


# ----------------------------------------------------------------------------- default split


@settings(max_examples=200)
@given(st.integers(1, 16), st.data())
def test_default_split_keeps_stage_zero_light(pp: int, data: st.DataObject) -> None:
    """When ``pp * vpp`` does not divide the layers, the default split counts the
    embedding and the loss as one layer each (Megatron's ``account_for_*_in_pipeline_split``):
    the first chunk holds no more layers than any other, the chunk loads in those units
    differ by at most one where every chunk can reach them (``L + 2 >= 2K``)."""
    vpp = 1 if pp == 1 else data.draw(st.integers(1, 3))
    k = pp * vpp
    layers = data.draw(st.integers(max(2, k), 130))
    base = model_from_hf_config(SPECS / "Qwen2.5-0.5B.json").hf_config()
    spec = model_from_hf_config({**base, "num_hidden_layers": layers})
    plan = stages_for(spec, ParallelDims(pp=pp, vpp=vpp))
    assert sum(plan.stage_lengths) == layers and min(plan.stage_lengths) >= 1
    if layers % k == 0:
        assert plan.stage_lengths == (layers // k,) * k  # Megatron's own default
        return
    assert plan.stage_lengths[0] == min(plan.stage_lengths)
    units = [n + (j == 0) + (j == k - 1) for j, n in enumerate(plan.stage_lengths)]
    if layers + 2 >= 2 * k:
        assert max(units) - min(units) <= 1
        assert max(units) == -(-(layers + 2) // k)


@pytest.mark.parametrize(
    ("name", "pp", "vpp"), [("Qwen3-235B-A22B", 8, 2), ("Llama-3.1-405B", 8, 2)]
)
def test_default_split_of_real_models(name: str, pp: int, vpp: int) -> None:
    """94 layers on 16 chunks and 126 on 16: the embedding and the loss weigh one layer
    each, as in the published recipes for these models (96 and 128 units)."""
    spec = model_from_hf_config(SPECS / f"{name}.json")
    plan = stages_for(spec, ParallelDims(pp=pp, vpp=vpp))
    q = (spec.num_layers + 2) // (pp * vpp)
    assert plan.stage_lengths == (q - 1, *(q,) * (pp * vpp - 2), q - 1)
