"""Our pipeline plans, read back by Megatron-Core 0.16 itself.

The layout string goes through Megatron's own parser (``PipelineParallelLayerLayout``)
and through ``TransformerConfig``; Megatron's ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` must then place exactly the layers the plan says on every
(pp rank, vp stage). Megatron reads the pipeline rank from ``parallel_state``; the
tests set it (and the virtual pipeline size) and restore the previous values.
"""

import functools
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from areal_fn.model.spec import model_from_hf_config
from areal_fn.pipeline.costs import flop_costs, megatron_moe_layers, partition_model
from areal_fn.pipeline.partition import (
    StagePlan,
    megatron_layout_string,
    partition_pipeline,
    split_evenly,
)
from areal_fn.testing.pipeline import stage_plans

ps = pytest.importorskip("megatron.core.parallel_state")
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (  # noqa: E402
    get_moe_layer_pattern,
)
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import LayerType  # noqa: E402
from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: E402
    PipelineParallelLayerLayout,
)
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"


@pytest.fixture
def megatron_rank() -> Iterator[None]:
    """Lets a test set Megatron's pipeline rank and vpp size; restores them after."""
    saved = (ps._MPU_PIPELINE_MODEL_PARALLEL_RANK, ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)
    try:
        yield
    finally:
        ps.set_pipeline_model_parallel_rank(saved[0])
        ps.set_virtual_pipeline_model_parallel_world_size(saved[1])


def _expected(plan: StagePlan) -> dict[tuple[int, int], list[int]]:
    return {
        (j % plan.num_stages, j // plan.num_stages): list(plan.chunk_layers(j))
        for j in range(plan.num_chunks)
    }


def _layout_layers(plan: StagePlan) -> dict[tuple[int, int], list[int]]:
    """(pp rank, vp stage) -> decoder layer ids, as Megatron's layout object says."""
    layout = PipelineParallelLayerLayout(megatron_layout_string(plan), plan.num_stages)
    assert layout.virtual_pipeline_model_parallel_size == plan.vpp
    assert layout.validate_layer_layout(num_layers=plan.num_layers, mtp_num_layers=None) is False
    ps.set_virtual_pipeline_model_parallel_world_size(plan.vpp if plan.vpp > 1 else None)
    return {
        (r, v): layout.get_layer_id_list(LayerType.decoder, vp_stage=v, pp_rank=r)
        for r in range(plan.num_stages)
        for v in range(plan.vpp)
    }


def _config_layers(plan: StagePlan, **split: object) -> dict[tuple[int, int], list[int]]:
    """The same through TransformerConfig and Megatron's layer-offset functions; with
    ``split`` (Megatron's own split options) instead of our layout string."""
    config = TransformerConfig(
        num_layers=plan.num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=plan.num_stages,
        virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
        pipeline_dtype=torch.float32,
        **(split or {"pipeline_model_parallel_layout": megatron_layout_string(plan)}),  # type: ignore[arg-type]
    )
    ps.set_virtual_pipeline_model_parallel_world_size(plan.vpp if plan.vpp > 1 else None)
    out = {}
    for r in range(plan.num_stages):
        ps.set_pipeline_model_parallel_rank(r)
        for v in range(plan.vpp):
            vp = v if plan.vpp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp)
            count = get_num_layers_to_build(config, vp_stage=vp)
            out[(r, v)] = list(range(offset, offset + count))
    return out


@settings(max_examples=60)
@given(stage_plans(max_layers=16, max_stages=4, max_vpp=3))
def test_megatron_parses_our_layout_and_places_the_same_layers(plan: StagePlan) -> None:
    saved = ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    try:
        assert _layout_layers(plan) == _expected(plan)
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(saved)


@settings(max_examples=60)
@given(stage_plans(max_layers=16, max_stages=4, max_vpp=3, allow_empty_ends=True))
def test_megatron_places_our_layout_with_empty_first_or_last_chunk(plan: StagePlan) -> None:
    saved = ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    try:
        assert _layout_layers(plan) == _expected(plan)
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(saved)


@pytest.mark.parametrize("vpp", [1, 2])
def test_transformer_config_builds_empty_first_and_last_chunks(
    megatron_rank: None, vpp: int
) -> None:
    plan = partition_pipeline(
        [1.0] * 9, 3, vpp=vpp, first_extra=9.0, last_extra=9.0, allow_empty_ends=True
    )
    assert plan.stage_lengths[0] == 0 and plan.stage_lengths[-1] == 0
    assert _config_layers(plan) == _expected(plan)


@pytest.mark.parametrize(
    ("layers", "pp", "vpp"),
    [(6, 2, 1), (94, 8, 2), (126, 8, 2), (22, 4, 2), (13, 3, 1), (30, 4, 1)],
)
def test_split_accounting_for_ends_is_megatrons_account_for_split(
    megatron_rank: None, layers: int, pp: int, vpp: int
) -> None:
    """``split_evenly(account_for_ends=True)`` places the layers exactly as Megatron does
    with ``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split``."""
    plan = split_evenly([1.0] * layers, pp, vpp=vpp, account_for_ends=True)
    megatron = _config_layers(
        plan,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    )
    assert megatron == _expected(plan)


@pytest.mark.parametrize(
    ("name", "pp", "vpp"),
    [
        ("Qwen3-235B-A22B", 8, 2),
        ("Llama-3.1-405B", 16, 2),
        ("Qwen2.5-72B", 8, 1),
        ("Qwen3-30B-A3B", 4, 3),
    ],
)
def test_transformer_config_builds_our_real_model_plans(
    megatron_rank: None, name: str, pp: int, vpp: int
) -> None:
    spec = model_from_hf_config(SPECS / f"{name}.json")
    plan = partition_model(
        spec, pp, vpp=vpp, cost_model=functools.partial(flop_costs, seq_len=4096)
    )
    assert _config_layers(plan) == _expected(plan)
    for layer in range(plan.num_layers):
        rank, vstage, local = plan.locate(layer)
        assert _expected(plan)[(rank, vstage)][local] == layer


@pytest.mark.parametrize("vpp", [1, 2])
def test_transformer_config_accepts_single_layer_chunks(megatron_rank: None, vpp: int) -> None:
    plan = partition_pipeline(
        [1.0, 9.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0], 4 if vpp == 1 else 3, vpp=vpp
    )
    assert _config_layers(plan) == _expected(plan)


@pytest.mark.parametrize("freq", [1, 2, 3, 4, 7, [1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0]])
def test_moe_layer_pattern_matches_megatron(freq: int | list[int]) -> None:
    config = types.SimpleNamespace(moe_layer_freq=freq, num_layers=14)
    assert megatron_moe_layers(14, freq) == tuple(bool(x) for x in get_moe_layer_pattern(config))


@pytest.mark.parametrize(
    ("name", "pp", "vpp"),
    [("DeepSeek-V3", 8, 4), ("DeepSeek-V3", 16, 1), ("GLM-4.5", 8, 2), ("GLM-4.5-Air", 4, 1)],
)
def test_megatron_places_our_split_with_the_mtp_layer_in_the_last_chunk(
    megatron_rank: None, name: str, pp: int, vpp: int
) -> None:
    """With multi-token-prediction layers, ``stages_for``'s split written with
    ``megatron_layout_string(mtp_layers=)`` is read by Megatron's own parser and
    ``TransformerConfig(mtp_num_layers=)``: the same decoder layers on every (pp rank, vp
    stage) and every MTP layer in the last chunk, the one with the loss."""
    from areal_fn.layouts.megatron import stages_for
    from areal_fn.strategy.allocation import ParallelDims

    spec = model_from_hf_config(SPECS / f"{name}.json", mtp=True)
    plan = stages_for(spec, ParallelDims(pp=pp, vpp=vpp))
    text = megatron_layout_string(plan, mtp_layers=spec.mtp_layers)
    layout = PipelineParallelLayerLayout(text, pp)
    assert layout.validate_layer_layout(spec.num_layers, spec.mtp_layers) is False
    ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    mtp = {
        (r, v): layout.get_layer_id_list(LayerType.mtp, vp_stage=v, pp_rank=r)
        for r in range(pp)
        for v in range(vpp)
    }
    assert {k: ids for k, ids in mtp.items() if ids} == {
        (pp - 1, vpp - 1): list(range(spec.mtp_layers))
    }
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32,
        mtp_num_layers=spec.mtp_layers,
        pipeline_model_parallel_layout=text,
    )
    for r in range(pp):
        ps.set_pipeline_model_parallel_rank(r)
        for v in range(vpp):
            vp = v if vpp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp)
            count = get_num_layers_to_build(config, vp_stage=vp)
            assert list(range(offset, offset + count)) == _expected(plan)[(r, v)], (r, v)
