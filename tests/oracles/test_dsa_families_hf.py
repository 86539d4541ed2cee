"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) against real transformers models
and the files ``save_pretrained`` writes.

Facts pinned here (transformers 5): every DSA layer holds ``self_attn.indexer.{wq_b,wk,
k_norm,weights_proj}`` after ``o_proj`` (``k_norm`` is a LayerNorm with a bias); GLM-5's
``"shared"`` layers hold no indexer; the config class writes ``layer_types``
(``indexed_attention``) and ``mlp_layer_types``. A tiny model of each is saved, read
into FSDP2 and inference layouts (``to_megatron`` per rank), gathered back (``to_hf``),
exported with ``write_hf_checkpoint`` and loaded by ``from_pretrained``: the same
tensors, bitwise, and the same logits.
"""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn import fsdp2_layout, inference_layout, model_from_hf_config
from areal_fn.model.hf_memory import canonical_to_hf_state, hf_memory_view, hf_state_to_canonical
from areal_fn.plans.convert import to_hf, to_megatron
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from areal_fn.testing.models import hf_configs

transformers = pytest.importorskip("transformers")

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"

_BASE: dict[str, object] = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "vocab_size": 90,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 3,  # fewer than the 8 tokens of the logits check: the top-k selects
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}

CONFIGS: dict[str, dict[str, object]] = {
    "deepseek_v32": {"model_type": "deepseek_v32", **_BASE},
    # layers 1 and 3 reuse the top-k of layers 0 and 2
    "glm_moe_dsa": {"model_type": "glm_moe_dsa", **_BASE, "indexer_types": ["full", "shared"] * 2},
}

#: Layouts read from the files: FSDP2 with TP and an inference TP2.
LAYOUTS = ("fsdp:d2t2", "vllm:t2")


def _build(cfg: dict[str, object], *, meta: bool = False) -> torch.nn.Module:
    rest = dict(cfg)
    config = transformers.AutoConfig.for_model(str(rest.pop("model_type")), **rest)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the router bias and norms start constant: give them values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn_like(b))
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_files_to_layouts_and_back_to_a_loadable_checkpoint(tmp_path, name: str) -> None:
    model = _build(CONFIGS[name])
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["layer_types"] == ["indexed_attention"] * 4
    spec = model_from_hf_config(tmp_path / "hf")
    assert spec == model_from_hf_config(CONFIGS[name])
    indexed = tuple(layer.self_attn.indexer is not None for layer in model.model.layers)
    assert spec.indexer_layers == indexed
    assert indexed == ((True,) * 4 if name == "deepseek_v32" else (True, False) * 2)
    ref = model.state_dict()
    canon = hf_state_to_canonical(ref, spec)
    assert list(canon) == list(spec.tensor_names)
    with HfCheckpoint(tmp_path / "hf") as ckpt:
        ckpt.check(spec)
        for text in LAYOUTS:
            make = fsdp2_layout if text.startswith("fsdp") else inference_layout
            layout = make(spec, text)
            states = {r: to_megatron(ckpt.read, layout, r) for r in range(layout.world_size)}
            back = to_hf(states, layout, check_replicas=True)
            assert back.keys() == canon.keys()
            assert all(torch.equal(back[k], canon[k]) for k in canon), text
    out = write_hf_checkpoint(tmp_path / "out", back, model=spec, max_shard_bytes=30_000)
    assert model_from_hf_config(out) == spec
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = loaded.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 8, 4]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_the_exported_config_builds_the_same_computation() -> None:
    """``hf_config()`` alone gives transformers the same model: equal logits from equal
    weights (GLM-5's shared layers included)."""
    for name in sorted(CONFIGS):
        model = _build(CONFIGS[name])
        spec = model_from_hf_config(CONFIGS[name])
        again = _build(spec.hf_config())
        again.load_state_dict(model.state_dict(), strict=True)
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        assert torch.equal(model(ids).logits, again(ids).logits), name
        assert type(again).__name__ == spec.family.architecture


@settings(max_examples=20, deadline=None)
@given(cfg=st.sampled_from(sorted(CONFIGS)).flatmap(lambda f: hf_configs(f, max_layers=4)))
def test_random_configs_match_transformers(cfg: dict[str, object]) -> None:
    """Names and shapes of the real model (meta device), which layers hold an indexer,
    and a bitwise round trip of its in-memory state dict."""
    spec = model_from_hf_config(cfg)
    model = _build(cfg, meta=True)
    assert [(m.name, m.shape) for m in hf_memory_view(spec)] == [
        (k, tuple(v.shape)) for k, v in model.state_dict().items()
    ]
    indexed = tuple(layer.self_attn.indexer is not None for layer in model.model.layers)
    assert spec.indexer_layers == indexed
    real = _build(cfg)
    sd = real.state_dict()
    back = canonical_to_hf_state(hf_state_to_canonical(sd, spec), spec)
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name", ["DeepSeek-V3.2-Exp", "GLM-5"])
def test_published_configs_match_transformers_on_meta(name: str) -> None:
    """The published configs: names, shapes and parameter count of the real model."""
    cfg = json.loads((SPECS / f"{name}.json").read_text())
    spec = model_from_hf_config(cfg)
    model = _build({k: v for k, v in cfg.items() if k != "quantization_config"}, meta=True)
    state = model.state_dict()
    assert [(m.name, m.shape) for m in hf_memory_view(spec)] == [
        (k, tuple(v.shape)) for k, v in state.items()
    ]
    assert spec.num_params == sum(v.numel() for v in state.values())
    assert all(layer.self_attn.indexer is not None for layer in model.model.layers)
