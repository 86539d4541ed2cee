"""One table of bad inputs to pipeline partitioning, with the messages they must raise."""

from pathlib import Path

import pytest

from areal_fn.errors import PlanError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.pipeline.costs import LayerCosts, megatron_moe_layers, param_costs, partition_model
from areal_fn.pipeline.partition import (
    Objective,
    StagePlan,
    module_names,
    partition_pipeline,
    split_evenly,
)

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
DENSE = model_from_hf_config(SPECS / "Qwen2.5-0.5B.json")
MOE = model_from_hf_config(SPECS / "Qwen3-30B-A3B.json")
NAN = float("nan")
INF = float("inf")
PLAN = partition_pipeline([1.0] * 4, 2)


def _short_costs(spec: object) -> LayerCosts:
    return LayerCosts(layers=(1.0, 2.0), embedding=0.0, head=0.0, unit="x")


CASES = [
    (
        "fewer layers than chunks",
        lambda: partition_pipeline([1.0] * 5, 4, vpp=2),
        r"5 layers cannot fill num_stages=4 x vpp=2 = 8 chunks: every chunk needs at least one "
        r"layer; use num_stages \* vpp <= 5 \(e.g. num_stages=4, vpp=1\), or a model with more layers",
    ),
    (
        "fewer layers than stages",
        lambda: partition_pipeline([1.0] * 3, 8),
        r"3 layers cannot fill num_stages=8 x vpp=1 = 8 chunks.*use num_stages \* vpp <= 3 \(e.g. num_stages=3, vpp=1\)",
    ),
    (
        "no layers",
        lambda: partition_pipeline([], 1),
        r"costs is empty: there are no layers to place; give one cost per decoder layer",
    ),
    (
        "vpp with one stage",
        lambda: partition_pipeline([1.0] * 8, 1, vpp=2),
        r"vpp=2 with num_stages=1: virtual pipeline stages interleave chunks over several "
        r"pipeline ranks, so they need num_stages >= 2; use vpp=1, or num_stages >= 2",
    ),
    ("zero stages", lambda: partition_pipeline([1.0], 0), r"num_stages=0 must be an int >= 1"),
    ("zero vpp", lambda: partition_pipeline([1.0, 1.0], 2, vpp=0), r"vpp=0 must be an int >= 1"),
    (
        "NaN cost",
        lambda: partition_pipeline([1.0, NAN, 2.0], 2),
        r"costs\[1\]=nan is not a positive finite number; every layer cost must be > 0 and "
        r"finite .*; fix the cost model, or give the layer a small positive cost",
    ),
    (
        "zero cost",
        lambda: partition_pipeline([1.0, 0.0], 2),
        r"costs\[1\]=0.0 is not a positive finite number",
    ),
    (
        "negative cost",
        lambda: partition_pipeline([-3.0, 1.0], 1),
        r"costs\[0\]=-3.0 is not a positive finite number",
    ),
    (
        "infinite cost",
        lambda: partition_pipeline([1.0, INF], 1),
        r"costs\[1\]=inf is not a positive finite number",
    ),
    (
        "non-number cost",  # through the record: beartype checks one random list item
        lambda: StagePlan(costs=(1.0, "2"), num_stages=1, stage_lengths=(2,)),
        r"costs\[1\]='2' is not a number; every layer cost must be a float > 0",
    ),
    (
        "bool cost",
        lambda: StagePlan(costs=(True,), num_stages=1, stage_lengths=(1,)),
        r"costs\[0\]=True is not a number",
    ),
    (
        "negative extra",
        lambda: partition_pipeline([1.0, 1.0], 2, first_extra=-1.0),
        r"first_extra=-1.0 must be finite and >= 0 \(it is added to the first chunk's load\); pass 0.0",
    ),
    (
        "NaN extra",
        lambda: partition_pipeline([1.0], 1, last_extra=NAN),
        r"last_extra=nan must be finite and >= 0 \(it is added to the last chunk's load\)",
    ),
    (
        "even split too short",
        lambda: split_evenly([1.0] * 3, 2, vpp=2),
        r"3 layers cannot fill num_stages=2 x vpp=2 = 4 chunks",
    ),
    (
        "plan lengths count",
        lambda: StagePlan(costs=(1.0,) * 4, num_stages=2, stage_lengths=(4,)),
        r"StagePlan has 1 stage_lengths for num_stages=2 x vpp=1 = 2 chunks; give one length per chunk",
    ),
    (
        "plan lengths sum",
        lambda: StagePlan(costs=(1.0,) * 4, num_stages=2, stage_lengths=(2, 1)),
        r"StagePlan.stage_lengths sum to 3 layers but costs has 4; every layer must be in exactly one chunk",
    ),
    (
        "plan empty chunk",
        lambda: StagePlan(costs=(1.0,) * 4, num_stages=2, stage_lengths=(4, 0)),
        r"StagePlan.stage_lengths\[1\]=0 must be an int >= 1: every chunk holds at least one layer",
    ),
    (
        "plan empty end without allow_empty_ends",
        lambda: StagePlan(costs=(1.0,) * 4, num_stages=2, stage_lengths=(0, 4)),
        r"StagePlan.stage_lengths\[0\]=0 must be an int >= 1: every chunk holds at least one "
        r"layer; pass allow_empty_ends=True to let the first chunk hold only the embedding or "
        r"the last only the head and loss",
    ),
    (
        "plan negative length",
        lambda: StagePlan(costs=(1.0,) * 4, num_stages=2, stage_lengths=(5, -1)),
        r"StagePlan.stage_lengths\[1\]=-1 must be an int >= 1",
    ),
    (
        "plan empty inner chunk with allow_empty_ends",
        lambda: StagePlan(
            costs=(1.0,) * 4, num_stages=3, stage_lengths=(2, 0, 2), allow_empty_ends=True
        ),
        r"StagePlan.stage_lengths\[1\]=0 is an empty inner chunk: allow_empty_ends=True lets "
        r"only the first and the last chunk be empty; give chunk 1 at least one layer",
    ),
    (
        "open ends, fewer layers than inner chunks",
        lambda: partition_pipeline([1.0] * 2, 5, allow_empty_ends=True),
        r"2 layers cannot fill the 3 inner chunks of num_stages=5 x vpp=1 = 5 chunks: "
        r"allow_empty_ends=True lets only the first and the last chunk be empty, every inner "
        r"chunk needs at least one layer; use num_stages \* vpp <= 4, or a model with more layers",
    ),
    (
        "open-ended plan, fewer layers than inner chunks",
        lambda: StagePlan(
            costs=(1.0,), num_stages=2, vpp=2, stage_lengths=(0, 1, 0, 0), allow_empty_ends=True
        ),
        r"1 layers cannot fill the 2 inner chunks of num_stages=2 x vpp=2 = 4 chunks",
    ),
    (
        "even split accounting for ends, too short",
        lambda: split_evenly([1.0] * 3, 4, account_for_ends=True),
        r"3 layers cannot fill num_stages=4 x vpp=1 = 4 chunks",
    ),
    (
        "given plan claims optimality",
        lambda: StagePlan(costs=(1.0,) * 2, num_stages=2, stage_lengths=(1, 1), rank_optimal=True),
        r"a given split is not proven optimal; leave rank_optimal=False",
    ),
    (
        "plan bad objective",
        lambda: StagePlan(costs=(1.0,), num_stages=1, stage_lengths=(1,), objective="chunk"),  # type: ignore[arg-type]
        r"objective",
    ),
    (
        "plan zero stages",
        lambda: StagePlan(costs=(1.0,), num_stages=0, stage_lengths=(1,)),
        r"num_stages=0 must be an int >= 1",
    ),
    (
        "plan lengths not a sequence",
        lambda: StagePlan(costs=(1.0,), num_stages=1, stage_lengths=1),
        r"StagePlan.stage_lengths=1 is not a sequence",
    ),  # type: ignore[arg-type]
    (
        "locate out of range",
        lambda: PLAN.locate(4),
        r"layer=4 is outside this plan's 4 layers; use 0..3",
    ),
    (
        "module pattern without index",
        lambda: module_names(PLAN, layer="layers"),
        r"layer='layers' does not place the layer index; use a pattern with one '\{\}'",
    ),
    (
        "megatron moe_layer_freq zero",
        lambda: megatron_moe_layers(4, 0),
        r"moe_layer_freq=0 must be >= 1 \(one MoE layer every N layers, starting at layer 0\)",
    ),
    (
        "megatron moe pattern length",
        lambda: megatron_moe_layers(4, [1, 0, 1]),
        r"moe_layer_freq list has 3 entries \[1, 0, 1\]...; it needs one 0/1 per layer \(num_layers=4\)",
    ),
    (
        "megatron moe pattern values",
        lambda: megatron_moe_layers(2, [1, 2]),
        r"it needs one 0/1 per layer",
    ),
    (
        "moe_layer_freq on dense model",
        lambda: param_costs(DENSE, moe_layer_freq=2),
        r"moe_layer_freq=2 given for a dense qwen2 model \(num_experts=0\); drop moe_layer_freq or use an MoE model",
    ),
    (
        "expert parallel does not divide experts",
        lambda: param_costs(MOE, expert_parallel=3),
        r"expert_parallel=3 does not divide num_experts=128; every expert-parallel rank holds the "
        r"same number of experts, use expert_parallel in \[1, 2, 4, 8, 16, 32, 64, 128\]",
    ),
    (
        "cost model with wrong layer count",
        lambda: partition_model(DENSE, 2, cost_model=_short_costs),
        r"cost model gave 2 layer costs for a model with num_layers=24; it must cost every decoder layer once",
    ),
    (
        "layer costs non-positive",
        lambda: LayerCosts(layers=(1.0, 0.0), embedding=0.0, head=0.0, unit="x"),
        r"LayerCosts.layers\[1\]=0.0 must be a positive finite number",
    ),
    (
        "layer costs empty",
        lambda: LayerCosts(layers=(), embedding=0.0, head=0.0, unit="x"),
        r"LayerCosts.layers is empty",
    ),
    (
        "layer costs negative head",
        lambda: LayerCosts(layers=(1.0,), embedding=0.0, head=-1.0, unit="x"),
        r"LayerCosts.head=-1.0 must be finite and >= 0",
    ),
    (
        "layer costs no unit",
        lambda: LayerCosts(layers=(1.0,), embedding=0.0, head=0.0, unit=""),
        r"LayerCosts.unit='' must name the unit",
    ),
]


@pytest.mark.parametrize(
    ("call", "pattern"), [(c, p) for _, c, p in CASES], ids=[n for n, _, _ in CASES]
)
def test_bad_input_raises_plan_error(call: object, pattern: str) -> None:
    with pytest.raises((PlanError, TypeError), match=pattern) as info:
        call()  # type: ignore[operator]
    if info.type is TypeError:  # only the attrs type validator may raise TypeError
        assert "objective" in str(info.value)
    assert Objective.GIVEN.value == "given"
