"""Multi-token-prediction layers as canonical tensors (``mtp=True``): the published names
and totals, the spec round trip, what each layout does with them (inference carries them,
fsdp refuses them; megatron's are in test_mtp_megatron.py), conversion and weight-sync
plans over them, the readers."""

import math
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn import ParallelDims, check_strategy, inference_layout
from areal_fn.errors import ConversionError, LayoutError, SpecError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import to_hf, to_megatron
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.plans.transfer.apply import apply_transfers
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from areal_fn.sharding.placement import Replicate
from areal_fn.testing.layouts import inference_dims_for
from areal_fn.testing.models import hf_configs, model_specs
from tests.laws.test_strided_transfer import blank, check

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"

#: Totals with the MTP layer, billions: DeepSeek's model card ("685B ... 671B of the Main
#: Model weights and 14B of the Multi-Token Prediction (MTP) Module weights") and the
#: Hugging Face pages' safetensors counts of Z.ai's checkpoints (358B, 110B), which hold
#: the MTP layer. The main models' own figures are tested in test_model_specs.py.
WITH_MTP = {"DeepSeek-V3": 685.0, "GLM-4.5": 358.0, "GLM-4.5-Air": 110.0}

#: DeepSeek-V3's layer 61 as its checkpoint index names it, experts aside.
DEEPSEEK_V3_MTP = [
    "embed_tokens.weight",
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "self_attn.q_a_proj.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
]


@pytest.mark.parametrize("name", sorted(WITH_MTP))
def test_published_totals_with_the_mtp_layer(name: str) -> None:
    main = model_from_hf_config(SPECS / f"{name}.json")
    spec = model_from_hf_config(SPECS / f"{name}.json", mtp=True)
    assert spec.mtp_layers == 1 and main.mtp_layers == 0
    assert math.isclose(spec.num_params, WITH_MTP[name] * 1e9, rel_tol=0.005)
    # the main model's tensors are unchanged and come first
    assert spec.tensors[: len(main.tensors)] == main.tensors


def test_deepseek_v3_mtp_layer_has_the_checkpoint_names_and_shapes() -> None:
    spec = model_from_hf_config(SPECS / "DeepSeek-V3.json", mtp=True)
    mtp = [t for t in spec.tensors if t.name.startswith("model.layers.61.")]
    assert [t.name[len("model.layers.61.") :] for t in mtp if ".experts." not in t.name] == (
        DEEPSEEK_V3_MTP
    )
    experts = {t.name for t in mtp if ".experts." in t.name}
    assert experts == {
        f"model.layers.61.mlp.experts.{e}.{p}_proj.weight"
        for e in range(256)
        for p in ("gate", "up", "down")
    }
    shapes = {t.name[len("model.layers.61.") :]: t.shape for t in mtp}
    assert shapes["eh_proj.weight"] == (7168, 2 * 7168)
    assert shapes["embed_tokens.weight"] == shapes["shared_head.head.weight"] == (129280, 7168)
    assert shapes["mlp.experts.0.gate_proj.weight"] == (2048, 7168)
    # 671B + 14B (the card's rounding of 13.46B)
    main = model_from_hf_config(SPECS / "DeepSeek-V3.json")
    assert round((spec.num_params - main.num_params) / 1e9) == 13


def test_kimi_k2_declares_no_mtp_layer() -> None:
    spec = model_from_hf_config(SPECS / "Kimi-K2-Instruct.json", mtp=True)
    assert spec.mtp_layers == 0 and spec == model_from_hf_config(SPECS / "Kimi-K2-Instruct.json")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["deepseek_v3", "glm4_moe"]).flatmap(hf_configs), st.booleans())
def test_the_spec_round_trips_through_its_config(cfg: dict[str, object], mtp: bool) -> None:
    spec = model_from_hf_config(cfg, mtp=mtp)
    assert model_from_hf_config(spec.hf_config(), mtp=spec.mtp_layers > 0) == spec
    assert spec.mtp_layers == (cfg.get("num_nextn_predict_layers", 1) if mtp else 0)
    names = [t.name for t in spec.tensors]
    assert len(names) == len(set(names))
    # every MTP layer follows the main model and holds its own embedding and head
    for j in range(spec.mtp_layers):
        p = f"model.layers.{spec.num_layers + j}."
        assert {p + "embed_tokens.weight", p + "shared_head.head.weight"} <= set(names)
    # the main model's layers are what they were, and the MTP layers are not among them
    assert spec.layer_tensors(spec.num_layers - 1) == model_from_hf_config(cfg).layer_tensors(
        spec.num_layers - 1
    )


@st.composite
def mtp_models(draw: st.DrawFn) -> ModelSpec:
    family = draw(st.sampled_from(["deepseek_v3", "glm4_moe"]))
    spec = draw(model_specs(family, mtp=True, max_layers=3))
    if spec.mtp_layers == 0:
        spec = model_from_hf_config({**spec.hf_config(), "num_nextn_predict_layers": 1}, mtp=True)
    return spec


def _canonical(model: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        t.name: torch.randn(t.shape, generator=g).to(getattr(torch, t.dtype)) for t in model.tensors
    }


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_inference_layouts_carry_mtp_layers_bitwise(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    dims = data.draw(inference_dims_for(model, max_world=8))
    layout = inference_layout(model, dims)
    canon = _canonical(model, 1)
    states = {r: to_megatron(canon, layout, r) for r in range(layout.world_size)}
    back = to_hf(states, layout, check_replicas=True)
    assert back.keys() == canon.keys()
    for name, t in canon.items():
        assert torch.equal(back[name], t), name
    # MTP tensors sit on the last pipeline stage; embed and head split like the main ones
    for t in layout.tensors:
        if t.name.startswith(f"model.layers.{model.num_layers}."):
            assert t.present == (("pp", dims.pp - 1),), t.name
    first = f"model.layers.{model.num_layers}."
    by = {t.name: t for t in layout.tensors}
    for mine in ("embed_tokens.weight", "shared_head.head.weight"):
        main = "model.embed_tokens.weight"
        assert by[first + mine].shape == by[main].shape
        assert by[first + mine].sharding.placements == by[main].sharding.placements
    assert isinstance(by[first + "eh_proj.weight"].sharding.placements[-1], Replicate)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_sync_plan_between_inference_layouts_moves_mtp_layers(data: st.DataObject) -> None:
    model = data.draw(mtp_models())
    src = inference_layout(model, data.draw(inference_dims_for(model, max_world=4)))
    dst = inference_layout(model, data.draw(inference_dims_for(model, max_world=4)))
    sr = list(range(src.world_size))
    dr = list(range(src.world_size, src.world_size + dst.world_size))
    canon = _canonical(model, 2)
    src_t = {g: to_megatron(canon, src, r) for r, g in enumerate(sr)}
    want = {g: to_megatron(canon, dst, r) for r, g in enumerate(dr)}
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    got = blank(want)
    apply_transfers(plan.transfers, src_t, got)
    check(want, got)
    moved = {t.canonical for t in plan.transfers}
    assert any(n.startswith(f"model.layers.{model.num_layers}.") for n in moved)
    again = blank(want)
    apply_transfers(bucket(plan, 64).transfers, src_t, again)
    check(want, again)


TINY = {
    "model_type": "deepseek_v3",
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "vocab_size": 16,
    "q_lora_rank": 4,
    "kv_lora_rank": 4,
    "qk_nope_head_dim": 2,
    "qk_rope_head_dim": 2,
    "v_head_dim": 2,
    "moe_intermediate_size": 4,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
}


MTP_REFUSAL = r"1 multi-token-prediction layer\(s\) \(model\.layers\.2\.\*, mtp_layers=1\)"


@pytest.mark.parametrize("alloc", ["fsdp:d2", "fsdp:t2"])
def test_the_fsdp_layout_refuses_mtp_layers(alloc: str) -> None:
    spec = model_from_hf_config(TINY, mtp=True)
    backend = alloc.split(":")[0]
    for call in (lambda: layout_for(spec, alloc), lambda: check_strategy(spec, alloc)):
        with pytest.raises(LayoutError, match=rf"{MTP_REFUSAL}.*To train with {backend}"):
            call()
    # without them the same allocation holds the model
    layout_for(model_from_hf_config(TINY), alloc)


def test_a_spec_of_a_family_without_mtp_layers_refuses_them() -> None:
    cfg = {
        "model_type": "qwen3",
        "num_key_value_heads": 2,
        "hidden_size": 8,
        "intermediate_size": 8,
        "head_dim": 4,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 16,
    }
    qwen = model_from_hf_config(cfg, mtp=True)
    assert qwen == model_from_hf_config(cfg)  # mtp=True adds what the config declares: none
    with pytest.raises(SpecError, match=r"mtp_layers=1: qwen3 has no multi-token-prediction"):
        attrs.evolve(qwen, mtp_layers=1)


def test_the_readers_take_mtp_layers_only_from_a_spec_that_holds_them(tmp_path: Path) -> None:
    spec = model_from_hf_config(TINY, mtp=True)
    canon = _canonical(spec, 3)
    out = write_hf_checkpoint(tmp_path / "ckpt", canon, model=spec)
    with HfCheckpoint(out) as ckpt:
        ckpt.check(spec)
        layout = inference_layout(spec, ParallelDims(tp=2), vocab_multiple=1)
        r1 = to_megatron({n: ckpt.read_full(n) for n in ckpt.names}, layout, 1)
        head = "model.layers.2.shared_head.head.weight"
        assert torch.equal(r1[head], canon[head][8:])
        beyond = r"unexpected \d+: .*layers \['2'\] are beyond num_hidden_layers.*mtp=True"
        with pytest.raises(ConversionError, match=beyond):
            ckpt.check(model_from_hf_config(TINY))
    # the config written is the spec's: read back with mtp=True it is the same spec
    assert model_from_hf_config(out, mtp=True) == spec
