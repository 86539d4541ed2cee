"""Laws of censuses and memory reports.

- The census computed from a model and degrees equals the census of the built layout
  (Megatron and FSDP2; published configs and drawn tiny models).
- Parameter bytes equal the plain per-tensor sum (:func:`local_param_bytes`) on every
  rank; the rank-class shortcut equals computing each rank alone.
- Conservation: summed over ranks, local elements equal every logical tensor times its
  replicas (so FSDP2 stores each element exactly once).
- Totals are sums of their columns; FSDP2 per-rank bytes halve when dp doubles, up to
  one row per tensor; the distributed optimizer shards state over data parallelism.
- Reports are deterministic; records evaluate back from their repr.
"""

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import default_stages, megatron_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.pipeline.partition import split_evenly
from areal_fn.plans.advisor.census import CensusIndex, census_of, fsdp2_census, megatron_census
from areal_fn.plans.memory import (
    ActivationModel,
    MemoryReport,
    Optimizer,
    PrecisionPolicy,
    estimate_memory,
    estimate_rows,
    local_param_bytes,
)
from areal_fn.sharding.placement import Partial, Replicate
from areal_fn.strategy.allocation import ParallelDims, divisors
from areal_fn.testing.layouts import fused_layouts
from areal_fn.testing.models import model_specs

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
ACT = ActivationModel(micro_batch_size=2, seq_len=512, recompute=False)


def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


@st.composite
def megatron_cases(draw: st.DrawFn) -> tuple[ModelSpec, ParallelDims]:
    """A tiny model and Megatron degrees valid for it (drawn from divisors)."""
    model = draw(model_specs(max_layers=4, max_experts=4, megatron=True))
    kv = model.num_key_value_heads
    sizes = (
        model.intermediate_size,
        model.q_lora_rank,  # multi-latent attention's sharded down projections
        model.kv_lora_rank + model.qk_rope_head_dim,
        model.num_shared_experts * model.moe_intermediate_size,
        model.shared_expert_size,  # the gated shared expert (Qwen3-Next, Qwen3.5)
        model.linear_attention.key_heads if model.linear_attention else 0,  # GatedDeltaNet
    )
    tp = draw(st.sampled_from([t for t in divisors(kv) if all(n % t == 0 for n in sizes)]))
    pp = draw(st.integers(1, model.num_layers))
    vpp = draw(
        st.sampled_from([v for v in (1, 2, 4) if pp > 1 and pp * v <= model.num_layers] or [1])
    )
    dp = draw(st.integers(1, 3))
    ep = 1
    if model.is_moe:
        ep = draw(st.sampled_from([e for e in divisors(model.num_experts) if (dp * tp) % e == 0]))
    return model, ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, vpp=vpp)


def _stages(model: ModelSpec, dims: ParallelDims):  # type: ignore[no-untyped-def]
    if model.num_layers % (dims.pp * dims.vpp) == 0:
        return default_stages(model, dims)
    return split_evenly([1.0] * model.num_layers, dims.pp, vpp=dims.vpp)


REAL_MEGATRON = [
    ("Qwen2.5-0.5B", ParallelDims(dp=2, tp=2, pp=2)),
    ("Qwen2.5-7B", ParallelDims(dp=2, tp=2, pp=2, vpp=2)),
    ("Llama-3.2-1B", ParallelDims(dp=2, pp=4)),
    ("Llama-3.1-8B", ParallelDims(dp=1, tp=8)),
    ("Qwen3-8B", ParallelDims(dp=2, tp=4, cp=2)),
    ("Qwen3-30B-A3B", ParallelDims(dp=2, tp=2, pp=2, ep=4)),
]
REAL_FSDP = [
    ("Qwen2.5-0.5B", ParallelDims(dp=3, tp=2)),
    ("Qwen2.5-7B", ParallelDims(dp=8)),
    ("Llama-3.2-1B", ParallelDims(dp=2, tp=4, cp=2)),
    ("Qwen3-30B-A3B", ParallelDims(dp=4, tp=2)),
]


@pytest.mark.parametrize(("name", "dims"), REAL_MEGATRON, ids=lambda v: str(v))
def test_megatron_census_equals_census_of_the_layout(name, dims):
    model = spec(name)
    assert megatron_census(model, dims) == census_of(megatron_layout(model, dims))


@pytest.mark.parametrize(("name", "dims"), REAL_FSDP, ids=lambda v: str(v))
def test_fsdp2_census_equals_census_of_the_layout(name, dims):
    model = spec(name)
    assert fsdp2_census(model, dims) == census_of(fsdp2_layout(model, dims))


@given(megatron_cases())
def test_megatron_census_equals_census_of_the_layout_drawn(case):
    model, dims = case
    stages = _stages(model, dims)
    layout = megatron_layout(model, dims, stages=stages)
    assert megatron_census(model, dims, stages=stages) == census_of(layout)


def _outcome(f, *args):  # type: ignore[no-untyped-def]
    try:
        return f(*args)
    except LayoutError as exc:
        return str(exc)


@given(megatron_cases())
def test_fsdp2_census_equals_census_of_the_layout_drawn(case):
    """Equal censuses, or the same refusal (uneven TP rows over more than two shards)."""
    model, dims = case
    fsdp = ParallelDims(dp=dims.dp * dims.pp, tp=dims.tp)
    layout = _outcome(fsdp2_layout, model, fsdp)
    want = layout if isinstance(layout, str) else census_of(layout)
    assert _outcome(fsdp2_census, model, fsdp) == want


@given(megatron_cases(), st.sampled_from(["bfloat16", "float32"]))
def test_params_equal_the_plain_sum_and_rank_classes_equal_single_ranks(case, dtype):
    model, dims = case
    stages = _stages(model, dims)
    layout = megatron_layout(model, dims, stages=stages)
    policy = PrecisionPolicy(param_dtype=dtype)
    report = estimate_memory(layout, policy, activation=ACT, model=model, dims=dims)
    for row in report.rows:
        assert row.params == local_param_bytes(layout, row.rank, dtype)
    alone = estimate_rows(
        layout, range(dims.world_size), policy, activation=ACT, model=model, dims=dims
    )
    assert alone == report.rows


@given(fused_layouts())
def test_params_equal_the_plain_sum_on_synthetic_layouts(layout):
    report = estimate_memory(layout, PrecisionPolicy.fp32())
    for row in report.rows:
        assert row.params == local_param_bytes(layout, row.rank, "float32")
        assert row.grads == row.params
        assert row.total == row.params + row.grads + row.optimizer


def _replicas(sharding, present) -> int:  # type: ignore[no-untyped-def]
    fixed = {a for a, _ in present}
    return math.prod(
        s
        for n, s, p in zip(
            sharding.mesh.names, sharding.mesh.sizes, sharding.placements, strict=True
        )
        if isinstance(p, Replicate | Partial) and n not in fixed
    )


@given(fused_layouts())
def test_local_elements_sum_to_every_tensor_times_its_replicas(layout):
    census = census_of(layout)
    index = CensusIndex(census)
    held = sum(index.share(r).numel for r in range(census.world_size))
    expected = sum(
        g.count * math.prod(g.shape) * _replicas(g.sharding, g.present) for g in census.groups
    )
    assert held == expected


@pytest.mark.parametrize(("name", "dims"), REAL_FSDP + REAL_MEGATRON, ids=lambda v: str(v))
def test_real_layouts_conserve_elements(name, dims):
    model = spec(name)
    census = (fsdp2_census if (name, dims) in REAL_FSDP else megatron_census)(model, dims)
    index = CensusIndex(census)
    held = sum(index.share(r).numel for r in range(census.world_size))
    expected = sum(
        g.count * math.prod(g.shape) * _replicas(g.sharding, g.present) for g in census.groups
    )
    assert held == expected


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Llama-3.2-1B", "Qwen3-30B-A3B"])
def test_fsdp2_without_tp_stores_every_element_once(name):
    model = spec(name)
    report = estimate_memory(fsdp2_census(model, ParallelDims(dp=6)), PrecisionPolicy.fp32())
    assert sum(r.params for r in report.rows) == 4 * model.num_params


def test_inference_layouts_hold_weights_only():
    model = spec("Qwen3-8B")
    dims = ParallelDims(dp=1, tp=16)  # 16 > 8 KV heads: each KV head on two ranks
    layout = inference_layout(model, dims)
    report = estimate_memory(layout)
    for row in report.rows:
        assert row.grads == row.optimizer == row.activations == row.buffers == 0
        assert row.params == local_param_bytes(layout, row.rank, "bfloat16")


@given(megatron_cases(), st.booleans())
def test_totals_are_the_sums_of_their_columns(case, recompute):
    model, dims = case
    act = ActivationModel(micro_batch_size=1, seq_len=64, recompute=recompute)
    census = megatron_census(model, dims, stages=_stages(model, dims))
    report = estimate_memory(census, activation=act, model=model, dims=dims)
    for r in report.rows:
        assert r.total == r.params + r.grads + r.optimizer + r.activations + r.buffers
        assert r.model_state == r.params + r.grads + r.optimizer
    assert report.max_total == max(r.total for r in report.rows)
    assert report.max_rank.total == report.max_total


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Llama-3.1-8B", "Qwen3-30B-A3B"])
@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_fsdp2_doubling_dp_halves_bytes_up_to_one_row_per_tensor(name, dp):
    model = spec(name)
    one = fsdp2_census(model, ParallelDims(dp=dp))
    two = fsdp2_census(model, ParallelDims(dp=2 * dp))
    policy = PrecisionPolicy.bf16_mixed()
    a = estimate_memory(one, policy).rows[0]
    b = estimate_memory(two, policy).rows[0]
    # rank 0 holds ceil(n / dp) rows of every tensor: 2 * ceil(n / 2dp) - ceil(n / dp) in {0, 1}
    slack = sum(g.count * math.prod(g.shape[1:]) * DTYPE_BYTES["bfloat16"] for g in two.groups)
    assert a.params <= 2 * b.params <= a.params + slack
    if all(g.shape[0] % (2 * dp) == 0 for g in two.groups):
        assert 2 * b.params == a.params
    assert b.grads * DTYPE_BYTES["bfloat16"] == b.params * DTYPE_BYTES["float32"]


def test_distributed_optimizer_shards_state_over_data_parallel_ranks():
    model = spec("Qwen2.5-7B")
    policy = PrecisionPolicy.bf16_mixed()
    for dp in (1, 2, 4):
        census = megatron_census(model, ParallelDims(dp=dp, tp=2))
        sharded = estimate_memory(census, policy).rows[0]
        whole = estimate_memory(census, policy, distributed_optimizer=False).rows[0]
        assert sharded.params == whole.params and sharded.grads == whole.grads
        numel = whole.params // 2
        assert whole.optimizer == numel * 12 + 4 * census_tensors(census, 0)
        state = sharded.optimizer - 4 * census_tensors(census, 0)
        assert numel * 12 // dp <= state <= (numel + dp * len(census.groups)) * 12 // dp


def census_tensors(census, rank) -> int:  # type: ignore[no-untyped-def]
    return CensusIndex(census).share(rank).tensors


def test_activations_shrink_with_recompute_and_grow_with_the_micro_batch():
    model = spec("Qwen3-8B")
    dims = ParallelDims(dp=2, tp=2, pp=2)
    census = megatron_census(model, dims)

    def acts(mb: int, recompute: bool) -> int:
        act = ActivationModel(micro_batch_size=mb, seq_len=2048, recompute=recompute)
        return estimate_memory(census, activation=act, model=model, dims=dims).max_rank.activations

    assert acts(1, True) < acts(1, False) < acts(2, False)
    assert acts(2, False) <= 2 * acts(1, False) + 2


def test_first_pipeline_stage_keeps_more_micro_batches_in_flight():
    model = spec("Llama-3.1-8B")  # 32 layers: 8 per stage; the last stage also has the head
    dims = ParallelDims(dp=1, pp=4)
    act = ActivationModel(micro_batch_size=1, seq_len=4096)
    report = estimate_memory(megatron_census(model, dims), activation=act, model=model, dims=dims)
    acts = [r.activations for r in report.rows]
    assert acts[0] > acts[1] > acts[2]
    assert acts[0] == 4 * acts[3] - 4 * _head(model, act)


def _head(model: ModelSpec, act: ActivationModel) -> int:
    return act.tokens * (2 * model.hidden_size * 2 + model.vocab_size * 6)


def test_presets_bytes_per_param():
    assert PrecisionPolicy.bf16_mixed().bytes_per_param == 18
    assert PrecisionPolicy.fp32().bytes_per_param == 16
    assert PrecisionPolicy.fp32_params_bf16_compute().bytes_per_param == 16
    assert PrecisionPolicy.bf16_pure().bytes_per_param == 8
    assert PrecisionPolicy(optimizer="sgd", master_weights=False).bytes_per_param == 6
    assert PrecisionPolicy(optimizer="sgd_momentum").bytes_per_param == 14
    assert PrecisionPolicy(optimizer="adamw").optimizer is Optimizer.ADAM


@pytest.mark.parametrize(
    "record",
    [
        PrecisionPolicy.bf16_mixed(),
        PrecisionPolicy.bf16_pure(),
        PrecisionPolicy(optimizer=Optimizer.SGD, state_dtype="float16"),
        ActivationModel(micro_batch_size=3, seq_len=100, recompute=True),
    ],
)
def test_records_evaluate_back_from_repr(record):
    namespace = {
        "PrecisionPolicy": PrecisionPolicy,
        "ActivationModel": ActivationModel,
        "Optimizer": Optimizer,
    }
    assert eval(repr(record), namespace) == record


def test_reports_are_deterministic_and_print_rank_ranges():
    model = spec("Qwen2.5-7B")
    dims = ParallelDims(dp=2, tp=2, pp=2)
    layout = megatron_layout(model, dims)
    a = estimate_memory(layout, activation=ACT, model=model, dims=dims)
    b = estimate_memory(megatron_census(model, dims), activation=ACT, model=model, dims=dims)
    assert a == b and str(a) == str(b)
    text = str(a)
    assert "\n0-3 " in text and "\n4-7 " in text and "max: rank 0," in text
    assert isinstance(a, MemoryReport) and a.world_size == 8
