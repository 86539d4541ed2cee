"""Multi-token-prediction layers under Megatron-Core layouts, over random tiny
DeepSeek-V3 / GLM-4.5 models with MTP layers and random Megatron degrees.

Megatron-Core's MTP block uses the main model's embedding and output layer, so the
layout holds the checkpoint's MTP copies of them (``model.layers.{N}.embed_tokens``,
``shared_head.head``) as *tied* pieces of the main ones. The laws: conversion is
bitwise both ways when the copies equal the main tensors and refused, naming both,
when they differ; weight-sync plans to inference layouts and checkpoint plans carry
the copies; gradient-norm weights count each parameter element once.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn import ParallelDims, check_strategy, inference_layout, megatron_layout
from areal_fn.errors import ConversionError, LayoutError
from areal_fn.layouts.megatron import stages_for
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.pipeline.partition import StagePlan
from areal_fn.plans.advisor.census import CensusIndex, census_of, megatron_census
from areal_fn.plans.checkpoint.read import plan_load
from areal_fn.plans.checkpoint.write import plan_save
from areal_fn.plans.convert import to_hf, to_megatron, to_megatron_into
from areal_fn.plans.grad_norm import canonical_multiplicity, norm_weights
from areal_fn.plans.memory import ActivationModel, estimate_memory
from areal_fn.plans.transfer import plan_transfers
from areal_fn.plans.transfer.apply import apply_transfers
from areal_fn.sharding.box import Box
from areal_fn.strategy.rules import dims_problems
from areal_fn.testing.layouts import inference_dims_for, megatron_layouts_for
from tests.laws.test_mtp import SPECS, TINY, mtp_models
from tests.laws.test_strided_transfer import blank, check
from tests.manifest_util import weights_manifest


def copies(model: ModelSpec) -> dict[str, str]:
    """Each MTP copy -> the main tensor it must equal (computed from the names alone)."""
    head = "model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
    out = {}
    for j in range(model.mtp_layers):
        p = f"model.layers.{model.num_layers + j}."
        out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[p + "shared_head.head.weight"] = head
    return out


def canonical(model: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        t.name: torch.randn(t.shape, generator=g).to(getattr(torch, t.dtype)) for t in model.tensors
    }
    for copy, main in copies(model).items():
        out[copy] = out[main].clone()
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_megatron_layouts_carry_mtp_layers_bitwise(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    layout = data.draw(megatron_layouts_for(model, max_world=8))
    canon = canonical(model, 1)
    states = {r: to_megatron(canon, layout, r) for r in range(layout.world_size)}
    back = to_hf(states, layout, check_replicas=True)
    assert back.keys() == canon.keys()
    for name, t in canon.items():
        assert torch.equal(back[name], t), name
    # the MTP block sits on the last chunk; its copies are tied, never padding or alone
    plan = layout.stages
    assert plan is not None
    pre = f"model{plan.vpp - 1}." if plan.vpp > 1 else ""
    names = {t.name for t in layout.tensors}
    for j in range(model.mtp_layers):
        assert pre + f"mtp.layers.{j}.eh_proj.weight" in names
    for t in layout.tensors:
        for f in t.fusion:
            assert f.tied == (f.canonical in copies(model)), (t.name, f.canonical)
            if f.tied:
                assert t.present == (("pp", plan.num_stages - 1),), t.name


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_an_mtp_copy_that_differs_from_the_main_tensor_is_refused(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    layout = data.draw(megatron_layouts_for(model, max_world=8))
    canon = canonical(model, 2)
    copy = data.draw(st.sampled_from(sorted(copies(model))))
    row = data.draw(st.integers(0, model.vocab_size - 1))
    canon[copy][row, 0] += 1.0
    cell = Box(ranges=((row, row + 1), (0, 1)))
    holders = sorted(
        {r for r, _, p in layout.holders(copy) if p.canonical_box.intersect(cell) is not None}  # type: ignore[union-attr]
    )
    assert holders  # the layout holds every element of the copy
    for r in holders:
        with pytest.raises(ConversionError, match=rf"{copy}.*{copies(model)[copy]}.*must be equal"):
            to_megatron(canon, layout, r)
        out = {lt.name: torch.empty(lt.shape) for lt in layout.local_tensors(r)}
        with pytest.raises(ConversionError, match="must be equal"):
            to_megatron_into(canon, layout, r, out=out, cast=True)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_sync_plan_from_megatron_to_inference_moves_the_mtp_layers(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    src = data.draw(megatron_layouts_for(model, max_world=4))
    dst = inference_layout(model, data.draw(inference_dims_for(model, max_world=4)))
    sr = list(range(src.world_size))
    dr = list(range(src.world_size, src.world_size + dst.world_size))
    canon = canonical(model, 3)
    src_t = {g: to_megatron(canon, src, r) for r, g in enumerate(sr)}
    want = {g: to_megatron(canon, dst, r) for r, g in enumerate(dr)}
    got = blank(want)
    apply_transfers(plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr).transfers, src_t, got)
    check(want, got)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_checkpoints_of_a_megatron_mtp_layout_hold_the_copies(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    saver = data.draw(megatron_layouts_for(model, max_world=8))
    loader = data.draw(
        st.one_of(
            megatron_layouts_for(model, max_world=8),
            st.builds(inference_layout, st.just(model), inference_dims_for(model, max_world=4)),
        )
    )
    canon = canonical(model, 4)
    plan = plan_save(saver)
    rebuilt = {n: torch.full_like(t, float("nan")) for n, t in canon.items()}
    for r in range(saver.world_size):
        local = to_megatron(canon, saver, r)
        for p in plan.for_rank(r):
            rebuilt[p.canonical][p.box.slices()] = local[p.tensor][p.local_box.slices()].reshape(
                p.box.shape
            )
    assert all(torch.equal(rebuilt[n], canon[n]) for n in canon)
    manifest = weights_manifest(plan, model)
    for r in range(loader.world_size):
        lp = plan_load(manifest, loader, r)
        want = to_megatron(canon, loader, r)
        got = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
        filled = {n: torch.zeros(t.shape, dtype=torch.int64) for n, t in want.items()}
        for rp in lp.reads:
            got[rp.tensor][rp.local_box.slices()] = canon[rp.canonical][rp.box.slices()].reshape(
                rp.local_box.shape
            )
            filled[rp.tensor][rp.local_box.slices()] += 1
        for pad in lp.padding:
            got[pad.tensor][pad.local_box.slices()] = 0.0
            filled[pad.tensor][pad.local_box.slices()] += 1
        assert all(torch.equal(got[n], want[n]) for n in want), r
        # every element is read once: a tied piece is not read again
        assert all(bool((f == 1).all()) for f in filled.values()), r


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_grad_norm_weights_count_each_parameter_element_once(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    layout = data.draw(megatron_layouts_for(model, max_world=8))
    canon = canonical(model, 5)
    mult = canonical_multiplicity(layout)
    assert set(mult) == {t.name for t in model.tensors} - set(copies(model))
    total = 0.0
    for r in range(layout.world_size):
        local = to_megatron(canon, layout, r)
        for name, pieces in norm_weights(layout, r).items():
            for box, w in pieces:
                total += w * float(local[name][box.slices()].double().pow(2).sum())
    # the norm of the canonical tensors a Megatron parameter stands for, copies once
    want = sum(float(canon[n].double().pow(2).sum()) for n in mult)
    assert math.isclose(total, want, rel_tol=1e-9)


def test_tp_must_divide_the_hidden_size_under_mtp_layers() -> None:
    # tp=4 divides the heads, the latents, the MLP widths; not hidden_size=10
    cfg = {**TINY, "num_attention_heads": 4, "hidden_size": 10, "kv_lora_rank": 6}
    spec = model_from_hf_config(cfg, mtp=True)
    texts = [p.text for p in dims_problems(spec, "megatron", ParallelDims(tp=4))]
    assert len(texts) == 1 and "hidden_size=10" in texts[0] and "eh_proj" in texts[0], texts
    with pytest.raises(LayoutError, match="eh_proj"):
        check_strategy(spec, "megatron:t4")
    assert dims_problems(model_from_hf_config(cfg), "megatron", ParallelDims(tp=4)) == ()


def test_an_empty_last_chunk_holds_the_mtp_block_and_the_final_norm_moves() -> None:
    # Megatron-Core's layout "Ett|mL": the final norm with the last decoder layer
    spec = model_from_hf_config(TINY, mtp=True)
    plan = StagePlan(
        costs=(1.0, 1.0), num_stages=2, vpp=1, stage_lengths=(2, 0), allow_empty_ends=True
    )
    layout = megatron_layout(spec, ParallelDims(pp=2), stages=plan)
    first, last = ({t.name for t in layout.local_tensors(r)} for r in (0, 1))
    assert "decoder.final_layernorm.weight" in first - last
    assert {"mtp.layers.0.eh_proj.weight", "output_layer.weight"} <= last - first
    assert "embedding.word_embeddings.weight" in first & last  # the MTP block's copy
    canon = canonical(spec, 6)
    states = {r: to_megatron(canon, layout, r) for r in range(2)}
    back = to_hf(states, layout, check_replicas=True)
    assert all(torch.equal(back[n], canon[n]) for n in canon)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_megatron_census_counts_the_mtp_block_as_the_layout_holds_it(
    data: st.DataObject,
) -> None:
    model = data.draw(mtp_models())
    drawn = data.draw(megatron_layouts_for(model, max_world=8))  # its degrees and stages
    dims = layout_dims(drawn)
    layout = megatron_layout(model, dims, stages=drawn.stages)  # the census's names
    census = megatron_census(model, dims, stages=drawn.stages)
    assert census == census_of(layout)
    # the MTP layers are among the last stage's layers (where memory and the score count
    # them), and only there
    index = CensusIndex(census)
    mtp = set(range(model.num_layers, model.num_layers + model.mtp_layers))
    per_stage = layout.world_size // dims.pp
    for r in range(layout.world_size):
        last = r // per_stage == dims.pp - 1
        assert (mtp <= set(index.share(r).layers)) == last, r
        assert bool(mtp & set(index.share(r).layers)) == last, r


def layout_dims(layout):  # type: ignore[no-untyped-def]
    """The degrees a Megatron layout was built with, read from its meshes."""
    dense = next(t.sharding.mesh for t in layout.tensors if "pp" in t.sharding.mesh.names)
    expert = [t.sharding.mesh for t in layout.tensors if "ep" in t.sharding.mesh.names]
    size = dict(zip(dense.names, dense.sizes, strict=True))
    ex = dict(zip(expert[0].names, expert[0].sizes, strict=True)) if expert else {}
    assert layout.stages is not None
    return ParallelDims(
        dp=size["dp"],
        tp=size["tp"],
        pp=size["pp"],
        cp=size["cp"],
        ep=ex.get("ep", 1),
        etp=ex.get("etp", 1),
        vpp=layout.stages.vpp,
    )


def test_the_mtp_layer_weighs_on_the_last_stage_in_memory_and_score() -> None:
    spec = model_from_hf_config(SPECS / "DeepSeek-V3.json", mtp=True)
    main = model_from_hf_config(SPECS / "DeepSeek-V3.json")
    dims = ParallelDims(dp=32, pp=8, ep=32, vpp=4)
    act = ActivationModel(micro_batch_size=1, seq_len=4096, recompute=True)
    stages = stages_for(spec, dims)  # the same split for both: "Et|t*2|...|t*2|mL"
    assert stages.stage_lengths[-1] == 0 and stages.stage_lengths[-2] == 2
    with_mtp, without = (
        estimate_memory(megatron_census(m, dims, stages=stages), activation=act, model=m, dims=dims)
        for m in (spec, main)
    )
    last, before = 255, 223  # ranks of the last stage and of the one before
    # parameters: the MTP layer and the last stage's copy of the embedding, counted from
    # the canonical shapes (bf16 parameters, one of 32 EP ranks' experts), less the final
    # norm, which moves to the stage holding the last decoder layer (chunk 30: stage 6)
    p = "model.layers.61."
    mtp = [t for t in spec.tensors if t.name.startswith(p)]
    mtp = [t for t in mtp if t.name != p + "shared_head.head.weight"]
    experts = sum(t.numel for t in mtp if ".experts." in t.name)
    want = sum(t.numel for t in mtp) - experts + experts // 32 - spec.hidden_size
    assert with_mtp.rows[last].params - without.rows[last].params == want * 2
    assert with_mtp.rows[before].params - without.rows[before].params == spec.hidden_size * 2
    assert with_mtp.rows[0].params == without.rows[0].params  # the first stage: unchanged
    assert with_mtp.rows[last].activations > without.rows[last].activations


def test_the_megatron_engine_refuses_mtp_layers_before_any_process_group() -> None:
    from areal_fn.runtime.engines.megatron import MegatronEngine

    message = (
        r"^the model has 1 multi-token-prediction layer\(s\) \(mtp_layers\): MegatronEngine "
        r"computes its loss from the main model's logits and does not train MTP layers "
        r"\(Megatron-Core adds their loss inside GPTModel's own loss only\); build the model "
        r"without them \(model_from_hf_config\(config\), the default\) and read the checkpoint "
        r"with drop_mtp=True. The megatron layout carries them for conversion, weight sync and "
        r"checkpoints$"
    )
    with pytest.raises(LayoutError, match=message):
        MegatronEngine(model_from_hf_config(TINY, mtp=True), ParallelDims())
    assert not torch.distributed.is_initialized()
