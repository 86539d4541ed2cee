"""Laws of pipeline partitioning: optimality (brute force), tiling, determinism,
monotonicity, the tie-break rule, and the cost models' invariants."""

import functools
import itertools
import math
from fractions import Fraction
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.model.spec import layer_of, model_from_hf_config
from areal_fn.pipeline.costs import (
    LayerCosts,
    flop_costs,
    megatron_moe_layers,
    memory_costs,
    param_costs,
    partition_model,
)
from areal_fn.pipeline.partition import (
    Objective,
    StagePlan,
    megatron_layout_string,
    module_names,
    partition_pipeline,
    split_evenly,
)
from areal_fn.testing.pipeline import PipelineProblem, layer_costs, pipeline_problems, stage_plans

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
MODELS = sorted(p.stem for p in SPECS.glob("*.json"))


# ----------------------------------------------------------------------------- oracles


def _exact_prefix(p: PipelineProblem) -> list[Fraction]:
    """Exact prefix loads, the extras on the first and last layer (every chunk is
    non-empty, so they always land on the first and last chunk)."""
    n = len(p.costs)
    prefix = [Fraction(0)]
    for i, c in enumerate(p.costs):
        step = Fraction(c)
        if i == 0:
            step += Fraction(p.first_extra)
        if i == n - 1:
            step += Fraction(p.last_extra)
        prefix.append(prefix[-1] + step)
    return prefix


def brute_force(
    p: PipelineProblem, *, balance_ranks: bool = True
) -> tuple[Fraction, Fraction, tuple[int, ...]]:
    """(optimal chunk bottleneck, best rank bottleneck among those, the tie-break winner),
    in exact arithmetic, over every partition."""
    n, s, v, k = len(p.costs), p.num_stages, p.vpp, p.num_chunks
    prefix = _exact_prefix(p)
    total = prefix[-1]

    def cut(j: int, pos: int) -> tuple[Fraction, int]:
        return abs(k * prefix[pos] - j * total), pos

    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        chunks = [prefix[b[j + 1]] - prefix[b[j]] for j in range(k)]
        ranks = [sum(chunks[j] for j in range(r, k, s)) for r in range(s)]
        if v > 1 and balance_ranks:
            order = [
                cut(i * s + r, b[i * s + r])
                for r in range(s)
                for i in range(v)
                if 0 < i * s + r < k
            ]
            key = (max(chunks), max(ranks), order)
        else:
            key = (max(chunks), Fraction(0), [cut(j, b[j]) for j in range(1, k)])
        if best is None or key < best[0]:
            best = (key, b)
    assert best is not None
    (chunk, _, _), b = best
    ranks_b = [sum(prefix[b[j + 1]] - prefix[b[j]] for j in range(r, k, s)) for r in range(s)]
    return chunk, Fraction(max(ranks_b)), b


def dp_bottleneck(costs: list[int], k: int) -> int:
    """O(k L^2) dynamic program on integers: the optimal bottleneck."""
    n = len(costs)
    prefix = [0, *itertools.accumulate(costs)]
    best = [0] + [math.inf] * n
    for _ in range(k):
        best = [math.inf] + [
            min((max(best[a], prefix[e] - prefix[a]) for a in range(e)), default=math.inf)
            for e in range(1, n + 1)
        ]
    return int(best[n])


def plan_of(
    p: PipelineProblem, *, balance_ranks: bool = True, rank_search_budget: int = 100_000
) -> StagePlan:
    return partition_pipeline(
        p.costs,
        p.num_stages,
        vpp=p.vpp,
        first_extra=p.first_extra,
        last_extra=p.last_extra,
        balance_ranks=balance_ranks,
        rank_search_budget=rank_search_budget,
    )


# ----------------------------------------------------------------------------- optimality


@given(pipeline_problems(max_layers=8))
def test_optimum_and_tie_break_match_brute_force(p: PipelineProblem) -> None:
    plan = plan_of(p)
    chunk, rank, b = brute_force(p)
    assert plan.max_load == float(chunk)
    assert plan.boundaries == b
    assert plan.rank_optimal
    assert plan.max_rank_load == float(rank)
    assert plan.objective is (Objective.CHUNK_THEN_RANK if p.vpp > 1 else Objective.CHUNK)


@given(pipeline_problems(max_layers=8, max_stages=3, max_vpp=3))
def test_chunk_only_plan_matches_brute_force(p: PipelineProblem) -> None:
    plan = plan_of(p, balance_ranks=False)
    chunk, _, b = brute_force(p, balance_ranks=False)
    assert plan.max_load == float(chunk)
    assert plan.boundaries == b
    assert plan.objective is Objective.CHUNK


@given(pipeline_problems(max_layers=8, max_stages=3, max_vpp=3))
def test_local_search_keeps_bottleneck_and_never_loses_to_chunk_plan(p: PipelineProblem) -> None:
    """With no budget for the exact rank search the plan comes from the local search."""
    plan = plan_of(p, rank_search_budget=0)
    chunk_only = plan_of(p, balance_ranks=False)
    chunk, rank, _ = brute_force(p)
    assert plan.max_load == float(chunk)
    assert float(rank) <= plan.max_rank_load <= chunk_only.max_rank_load
    assert plan.rank_optimal == (p.vpp == 1)


@settings(max_examples=40)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.integers(1, 8))
def test_bottleneck_matches_dynamic_program(costs: list[int], k: int) -> None:
    k = min(k, len(costs))
    plan = partition_pipeline([float(c) for c in costs], k)
    assert plan.max_load == dp_bottleneck(costs, k)


@given(pipeline_problems(max_layers=30, max_stages=4, max_vpp=3))
def test_rank_balancing_never_worse_than_chunk_plan(p: PipelineProblem) -> None:
    ranked, chunked = plan_of(p), plan_of(p, balance_ranks=False)
    assert ranked.max_load == chunked.max_load
    assert ranked.max_rank_load <= chunked.max_rank_load


@given(pipeline_problems(max_layers=30, max_stages=4, max_vpp=3))
def test_lower_bounds_hold(p: PipelineProblem) -> None:
    plan = plan_of(p)
    total = math.fsum((*p.costs, p.first_extra, p.last_extra))
    assert plan.max_load >= total / p.num_chunks * (1 - 1e-12)
    assert plan.max_rank_load >= total / p.num_stages * (1 - 1e-12)
    assert plan.max_load >= max(p.costs)
    even = split_evenly(
        p.costs, p.num_stages, vpp=p.vpp, first_extra=p.first_extra, last_extra=p.last_extra
    )
    assert plan.max_load <= even.max_load


# ----------------------------------------------------------------------------- monotone


@given(pipeline_problems(max_layers=30, max_stages=4, max_vpp=2), st.data())
def test_adding_cost_never_lowers_the_optimum(p: PipelineProblem, data: st.DataObject) -> None:
    before = plan_of(p).max_load
    where = data.draw(st.integers(-2, len(p.costs) - 1))
    more = data.draw(st.floats(1e-3, 1e3))
    if where == -2:
        heavier = attrs.evolve(p, first_extra=p.first_extra + more)
    elif where == -1:
        heavier = attrs.evolve(p, last_extra=p.last_extra + more)
    else:
        costs = list(p.costs)
        costs[where] += more
        heavier = attrs.evolve(p, costs=tuple(costs))
    assert plan_of(heavier).max_load >= before


@given(pipeline_problems(max_layers=20, max_stages=3, max_vpp=2), st.floats(0.25, 64.0))
def test_scaling_costs_by_a_power_of_two_scales_the_plan(p: PipelineProblem, factor: float) -> None:
    """Exactness: scaling every cost by 2**e changes no decision."""
    e = round(math.log2(factor))
    scaled = attrs.evolve(
        p,
        costs=tuple(math.ldexp(c, e) for c in p.costs),
        first_extra=math.ldexp(p.first_extra, e),
        last_extra=math.ldexp(p.last_extra, e),
    )
    a, b = plan_of(p), plan_of(scaled)
    assert a.stage_lengths == b.stage_lengths
    assert b.max_load == math.ldexp(a.max_load, e)


# ----------------------------------------------------------------------------- tiling


@given(stage_plans())
def test_every_layer_is_in_exactly_one_chunk(plan: StagePlan) -> None:
    seen = [j for j in range(plan.num_chunks) for _ in plan.chunk_layers(j)]
    assert len(seen) == plan.num_layers
    assert [i for j in range(plan.num_chunks) for i in plan.chunk_layers(j)] == list(
        range(plan.num_layers)
    )
    assert all(n >= 1 for n in plan.stage_lengths)
    for layer in range(plan.num_layers):
        rank, vstage, local = plan.locate(layer)
        j = vstage * plan.num_stages + rank
        assert plan.chunk_layers(j)[local] == layer
    assert sorted(j for r in range(plan.num_stages) for j in plan.rank_chunks(r)) == list(
        range(plan.num_chunks)
    )
    assert plan.chunk_ranks == tuple(j % plan.num_stages for j in range(plan.num_chunks))


@given(stage_plans())
def test_loads_conserve_the_total(plan: StagePlan) -> None:
    total = math.fsum((*plan.costs, plan.first_extra, plan.last_extra))
    assert math.isclose(math.fsum(plan.chunk_loads), total, rel_tol=1e-12)
    assert math.isclose(math.fsum(plan.rank_loads), total, rel_tol=1e-12)
    assert plan.max_load == max(plan.chunk_loads)


@given(stage_plans())
def test_module_names_cover_each_module_once(plan: StagePlan) -> None:
    names = module_names(plan)
    flat = [n for stage in names for n in stage]
    expected = [
        "tok_embeddings",
        *(f"layers.{i}" for i in range(plan.num_layers)),
        "norm",
        "output",
    ]
    assert flat == expected
    assert len(names) == plan.num_chunks
    hf = module_names(
        plan,
        embedding=("model.embed_tokens",),
        layer="model.layers.{}",
        head=("model.norm", "lm_head"),
    )
    assert hf[0][0] == "model.embed_tokens" and hf[-1][-1] == "lm_head"


@given(stage_plans())
def test_layout_string_counts_layers_in_chunk_order(plan: StagePlan) -> None:
    text = megatron_layout_string(plan)
    parts = text.split("|")
    assert len(parts) == plan.num_chunks
    assert parts[0].startswith("E") and parts[-1].endswith("L")
    for n, part in zip(plan.stage_lengths, parts, strict=True):
        body = part.removeprefix("E").removesuffix("L")
        assert body == ("t" if n == 1 else f"t*{n}")


# ----------------------------------------------------------------------------- determinism


@given(pipeline_problems(max_layers=25, max_stages=4, max_vpp=3))
def test_deterministic_and_input_type_independent(p: PipelineProblem) -> None:
    a = plan_of(p)
    b = partition_pipeline(
        list(p.costs), p.num_stages, vpp=p.vpp, first_extra=p.first_extra, last_extra=p.last_extra
    )
    c = partition_pipeline(
        np.array(p.costs),
        p.num_stages,
        vpp=p.vpp,
        first_extra=p.first_extra,
        last_extra=p.last_extra,
    )
    assert a == b == c
    assert str(a) == str(b)


@given(stage_plans())
def test_repr_is_valid_python(plan: StagePlan) -> None:
    assert eval(repr(plan), {"StagePlan": StagePlan, "Objective": Objective}) == plan


def test_str_is_a_readable_table() -> None:
    plan = partition_pipeline([1.0] * 10, 2, vpp=2, first_extra=0.5, last_extra=1.5)
    text = str(plan)
    assert text.splitlines()[0] == (
        "StagePlan pp=2 vpp=2 layers=10 objective=chunk_then_rank (rank load proven minimal)"
    )
    assert "+first" in text and "+last" in text
    assert text.splitlines()[-1].startswith("max chunk load 3.5; max rank load 6")


def test_uniform_layers_split_evenly_with_slack_spread() -> None:
    plan = partition_pipeline([1.0] * 94, 8, vpp=2)
    assert sorted(plan.stage_lengths) == [5, 5] + [6] * 14
    assert plan.max_load == 6.0 and plan.max_rank_load == 12.0
    assert partition_pipeline([1.0] * 80, 8).stage_lengths == (10,) * 8


def test_large_instance_is_optimal_by_certificate() -> None:
    """10,000 integer costs in 64 chunks: the plan reaches its bottleneck, and the greedy
    cut (fewest chunks for a cap) needs more than 64 chunks one unit below it."""
    rng = np.random.default_rng(0)
    costs = [int(c) for c in rng.integers(1, 10**6, size=10_000)]
    plan = partition_pipeline([float(c) for c in costs], 64, first_extra=5e6, last_extra=5e6)
    assert sum(plan.stage_lengths) == 10_000 and plan.max_load == max(plan.chunk_loads)
    weights = list(costs)
    weights[0] += 5 * 10**6
    weights[-1] += 5 * 10**6
    cap, chunks, load = int(plan.max_load) - 1, 1, 0
    for w in weights:
        if load + w > cap:
            chunks, load = chunks + 1, 0
        load += w
    assert chunks > 64


# ----------------------------------------------------------------------------- cost models


@pytest.mark.parametrize("name", MODELS)
def test_param_costs_equal_canonical_tensor_sizes(name: str) -> None:
    spec = model_from_hf_config(SPECS / f"{name}.json")
    costs = param_costs(spec)
    assert costs.layers == tuple(
        float(sum(t.numel for t in spec.layer_tensors(i))) for i in range(spec.num_layers)
    )
    assert costs.embedding == spec.tensor("model.embed_tokens.weight").numel
    assert costs.head == spec.vocab_size * spec.hidden_size + spec.hidden_size
    assert costs.unit == "params"


@pytest.mark.parametrize("name", MODELS)
def test_cost_models_give_one_positive_cost_per_layer(name: str) -> None:
    spec = model_from_hf_config(SPECS / f"{name}.json")
    for model in (
        param_costs,
        functools.partial(flop_costs, seq_len=2048),
        functools.partial(memory_costs, micro_batch_size=2, seq_len=2048),
    ):
        costs = model(spec)
        assert len(costs.layers) == spec.num_layers and min(costs.layers) > 0
        plan = partition_model(spec, 4, vpp=2, cost_model=model)
        assert plan.costs == costs.layers and plan.last_extra == costs.head


def test_attention_flops_grow_with_sequence_length() -> None:
    spec = model_from_hf_config(SPECS / "Qwen2.5-7B.json")
    per_token = [flop_costs(spec, seq_len=s).layers[0] / s for s in (1024, 2048, 4096, 8192)]
    assert per_token == sorted(per_token) and per_token[0] < per_token[-1]
    head = [flop_costs(spec, seq_len=s).head / s for s in (1024, 8192)]
    assert head[0] == head[1]  # the head is linear in tokens
    causal, full = flop_costs(spec, seq_len=4096), flop_costs(spec, seq_len=4096, causal=False)
    assert causal.layers[0] < full.layers[0]


def test_memory_grows_with_tokens_and_in_flight_micro_batches() -> None:
    spec = model_from_hf_config(SPECS / "Qwen3-8B.json")
    one = memory_costs(spec, micro_batch_size=1, seq_len=4096)
    two = memory_costs(spec, micro_batch_size=1, seq_len=4096, in_flight=2)
    params = param_costs(spec)
    assert two.layers[0] - one.layers[0] == one.layers[0] - params.layers[0] * 18.0
    assert one.head > params.head * 18.0


def test_moe_layers_follow_megatron_frequency_not_hf_sparse_step() -> None:
    assert megatron_moe_layers(6, 2) == (True, False, True, False, True, False)
    assert megatron_moe_layers(6, 3) == (True, False, False, True, False, False)
    assert megatron_moe_layers(3, [0, 1, 1]) == (False, True, True)
    spec = model_from_hf_config(SPECS / "Qwen3-30B-A3B.json")
    costs = param_costs(spec, moe_layer_freq=2)
    heavy = [i for i, c in enumerate(costs.layers) if c > min(costs.layers)]
    assert heavy == list(range(0, spec.num_layers, 2))
    # HF's decoder_sparse_step=2 would make layers 1, 3, 5, ... sparse instead
    hf = {**spec.hf_config(), "decoder_sparse_step": 2, "mlp_only_layers": []}
    hf_spec = model_from_hf_config(hf)
    hf_heavy = [
        i for i, c in enumerate(param_costs(hf_spec).layers) if c > min(param_costs(hf_spec).layers)
    ]
    assert hf_heavy == list(range(1, spec.num_layers, 2))


def test_expert_parallel_divides_expert_parameters() -> None:
    spec = model_from_hf_config(SPECS / "Qwen3-30B-A3B.json")
    one, eight = param_costs(spec), param_costs(spec, expert_parallel=8)
    experts = spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
    assert one.layers[0] - eight.layers[0] == experts - experts // 8


def test_a_cost_model_is_any_function() -> None:
    spec = model_from_hf_config(SPECS / "Qwen2.5-0.5B.json")

    def by_index(s: object) -> LayerCosts:
        return LayerCosts(
            layers=tuple(1.0 + i for i in range(spec.num_layers)),
            embedding=0.0,
            head=0.0,
            unit="index",
        )

    plan = partition_model(spec, 4, cost_model=by_index)
    assert plan.stage_lengths[0] > plan.stage_lengths[-1]


@given(layer_costs(min_layers=2, max_layers=20))
def test_layer_costs_strategy_is_valid(costs: tuple[float, ...]) -> None:
    assert all(0 < c < math.inf for c in costs)
    partition_pipeline(costs, 2)


def test_plan_plugs_into_megatron_layout() -> None:
    """``megatron_layout(stages=plan)`` puts every layer where ``plan.locate`` says."""
    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.strategy.allocation import ParallelDims

    spec = model_from_hf_config(SPECS / "Qwen2.5-0.5B.json")
    plan = partition_model(spec, 4, vpp=2, cost_model=functools.partial(flop_costs, seq_len=2048))
    layout = megatron_layout(spec, ParallelDims(pp=4, vpp=2), stages=plan)
    for rank in range(4):  # pp is the only axis: rank == pp coordinate
        names = {t.name for t in layout.local_tensors(rank)}
        held = {
            (int(n.split(".")[0].removeprefix("model")), int(n.split(".")[3]))
            for n in names
            if ".decoder.layers." in n
        }
        expected = {
            (v, local)
            for layer in range(spec.num_layers)
            for r, v, local in [plan.locate(layer)]
            if r == rank
        }
        assert held == expected


@pytest.mark.parametrize("name", ["DeepSeek-V3", "GLM-4.5-Air"])
def test_cost_models_weigh_the_mtp_layers_in_the_last_chunk(name: str) -> None:
    """With MTP layers the head (the last chunk) carries the MTP block: its canonical
    tensors but for the two tied to the main embedding and head, and the last stage's
    copy of the embedding; its decoder layer's FLOPs, ``eh_proj`` and a second pass
    through the output layer."""
    plain = model_from_hf_config(SPECS / f"{name}.json")
    spec = model_from_hf_config(SPECS / f"{name}.json", mtp=True)
    h, v = spec.hidden_size, spec.vocab_size
    mtp = [t for t in spec.tensors if (layer_of(t.name) or -1) >= spec.num_layers]
    tied = [t for t in mtp if t.name.endswith(("embed_tokens.weight", "shared_head.head.weight"))]
    assert len(tied) == 2 * spec.mtp_layers
    experts = sum(t.numel for t in mtp if ".experts." in t.name)
    untied = sum(t.numel for t in mtp) - sum(t.numel for t in tied)
    for ep in (1, 8):
        costs, costs0 = (
            param_costs(spec, expert_parallel=ep),
            param_costs(plain, expert_parallel=ep),
        )
        assert costs.head - costs0.head == untied - experts + experts // ep + v * h
        assert costs.layers == costs0.layers
    tokens = 4096
    flops, flops0 = flop_costs(spec, seq_len=tokens), flop_costs(plain, seq_len=tokens)
    moe_layer = flops.layers[-1]  # the last main layer has routed experts, as the MTP layer
    extra = moe_layer + 3 * 2 * (2 * h * h + h * v) * tokens
    assert math.isclose(flops.head - flops0.head, extra, rel_tol=1e-12)
    mem, mem0 = (memory_costs(m, micro_batch_size=1, seq_len=tokens) for m in (spec, plain))
    assert mem.head - mem0.head > (untied + v * h) * 18.0  # parameters and activations
    # the heavier last chunk: the last pipeline rank gets fewer decoder layers
    cut = functools.partial(flop_costs, seq_len=tokens)
    last = [
        sum(partition_model(m, 4, vpp=2, cost_model=cut).stage_lengths[3::4]) for m in (spec, plain)
    ]
    assert last[0] < last[1]
