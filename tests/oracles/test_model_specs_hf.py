"""Oracle: ModelSpec against real transformers models and the files save_pretrained writes.

Facts pinned here (transformers 5, safetensors):
- ``save_pretrained`` writes Qwen3-MoE experts one tensor per expert
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``), although the model holds them fused.
- A safetensors file lists its tensors sorted by name; our canonical order is the
  state-dict order (see ``areal_fn.model.spec``), compared against ``model.state_dict()``.
- Tied models write no ``lm_head.weight``.
- gpt-oss holds and writes its experts stacked (``mlp.experts.gate_up_proj [E, H, 2I]``,
  gate/up interleaved in columns, ``down_proj [E, I, H]``, their biases), its router as
  ``mlp.router.{weight,bias}`` and its attention sinks as ``self_attn.sinks [heads]``.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from areal_fn.model.hf_memory import canonical_to_hf_state, hf_memory_view, hf_state_to_canonical
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.testing.models import SLIDING_FAMILY_NAMES, gpt_oss_layer_types, hf_configs

transformers = pytest.importorskip("transformers")

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"

_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _build(cfg: dict[str, object], *, meta: bool = False) -> Any:
    spec = model_from_hf_config(cfg)  # its model_type: Kimi-K2's kimi_k2 is deepseek_v3
    if isinstance(cfg.get("text_config"), dict):  # Qwen3.5: the text model of a VLM config
        cfg = cfg["text_config"]
    rest = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")}
    config = transformers.AutoConfig.for_model(spec.model_type, **rest)
    dtype = torch_dtype(spec.dtype)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _read_checkpoint(
    path: Path,
) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, torch.Tensor]]:
    """(name -> (shape, dtype name), name -> tensor) of every safetensors file in ``path``."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted({path / f for f in weight_map.values()}) == files
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    data: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            keys = list(st.keys())
            assert keys == sorted(keys), "safetensors lists tensors sorted by name"
            for k in keys:
                sl = st.get_slice(k)
                meta[k] = (tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()])
                data[k] = st.get_tensor(k)
    if index.exists():
        assert set(weight_map) == set(meta)
    return meta, data


def _expanded_state_dict_order(model: Any, spec: ModelSpec) -> list[str]:
    """model.state_dict() names; a layer's fused expert tensors are replaced, at the first
    one, by their pieces expert-major (expert 0 of every fused tensor, then expert 1, ...);
    a tied ``lm_head.weight`` alias adds nothing."""
    view = {m.name: m for m in hf_memory_view(spec)}
    names = list(model.state_dict())
    out: list[str] = []
    for name in names:
        if ".mlp.experts." in name and spec.family.fused_experts:
            layer = name.split(".mlp.experts.")[0]
            group = [n for n in names if n.startswith(layer + ".mlp.experts.")]
            if name != group[0]:
                continue
            for e in range(spec.num_experts):
                for g in group:
                    out += [
                        p.canonical for p in view[g].pieces if p.memory_box.ranges[0] == (e, e + 1)
                    ]
            continue
        out += [p.canonical for p in view[name].pieces if p.canonical not in out]
    return out


def _canonical_numel(model: Any) -> int:
    """Parameters plus the persistent buffers a checkpoint stores (GLM's router bias);
    rotary frequency buffers are not stored."""
    stored = set(model.state_dict())
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in stored)
    return sum(p.numel() for p in model.parameters()) + buffers


def _check_model(cfg: dict[str, object], tmp_path: Path, *, shard: str | None = None) -> None:
    spec = model_from_hf_config(cfg)
    model = _build(cfg)
    sd = model.state_dict()
    # in-memory view == real state dict, in order
    assert [(m.name, m.shape) for m in hf_memory_view(spec)] == [
        (k, tuple(v.shape)) for k, v in sd.items()
    ]
    assert spec.num_params == _canonical_numel(model)
    assert list(spec.tensor_names) == _expanded_state_dict_order(model, spec)
    # what save_pretrained writes == canonical tensors
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    meta, disk = _read_checkpoint(tmp_path)
    assert meta == {t.name: (t.shape, t.dtype) for t in spec.tensors}
    if spec.tie_word_embeddings:
        assert "lm_head.weight" not in meta
    # exact conversion both ways, against the file transformers wrote
    canonical = hf_state_to_canonical(sd, spec)
    assert list(canonical) == list(spec.tensor_names)
    assert all(torch.equal(canonical[k], disk[k]) for k in disk)
    back = canonical_to_hf_state(disk, spec)
    assert list(back) == list(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    fresh = _build(cfg)
    fresh.load_state_dict(back, strict=True)
    assert all(torch.equal(v, sd[k]) for k, v in fresh.state_dict().items())


def _cfg(model_type: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "model_type": model_type,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 40,
        "torch_dtype": "float32",
    }
    base.update(kw)
    return base


_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_type": "llama3",
}

CASES = {
    "qwen2": _cfg("qwen2"),
    "qwen2-tied": _cfg("qwen2", tie_word_embeddings=True),
    "qwen3": _cfg("qwen3", head_dim=6),
    "qwen3-bias-tied": _cfg("qwen3", head_dim=8, attention_bias=True, tie_word_embeddings=True),
    "llama-untied": _cfg(
        "llama", rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0, max_position_embeddings=512
    ),
    "llama-tied": _cfg(
        "llama",
        tie_word_embeddings=True,
        head_dim=2,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=512,
    ),
    "llama-biases": _cfg("llama", attention_bias=True, mlp_bias=True, torch_dtype="bfloat16"),
    "mistral": _cfg("mistral", sliding_window=None, rope_theta=1e6),
    "mistral-tied-head-dim": _cfg(
        "mistral", sliding_window=None, head_dim=8, tie_word_embeddings=True
    ),
    "mixtral": _cfg("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "mixtral-tied-bf16": _cfg(
        "mixtral",
        num_hidden_layers=2,
        num_local_experts=3,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "glm4_moe": _cfg(
        "glm4_moe",
        head_dim=8,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
    ),
    "glm4_moe-bf16-air-like": _cfg(
        "glm4_moe",
        head_dim=8,
        moe_intermediate_size=4,
        n_routed_experts=3,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        routed_scaling_factor=2.5,
        torch_dtype="bfloat16",
    ),
    "deepseek_v3": _cfg(
        "deepseek_v3",
        num_key_value_heads=4,
        q_lora_rank=6,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=3,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "deepseek_v3-kimi-like-no-q-lora-bf16": _cfg(
        "deepseek_v3",
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=6,
        qk_nope_head_dim=2,
        qk_rope_head_dim=4,
        v_head_dim=5,
        moe_intermediate_size=4,
        n_routed_experts=3,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        first_k_dense_replace=2,
        routed_scaling_factor=2.827,
        torch_dtype="bfloat16",
    ),
    "gpt_oss": _cfg(
        "gpt_oss",
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "gpt_oss-tied-bf16-no-bias-plain-rope": _cfg(
        "gpt_oss",
        num_hidden_layers=2,
        num_local_experts=3,
        num_experts_per_tok=1,
        attention_bias=False,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "default"},
        torch_dtype="bfloat16",
    ),
    "olmo3": _cfg("olmo3", num_hidden_layers=5, sliding_window=3),
    "olmo2": _cfg("olmo2", num_hidden_layers=3),
    "olmo2-bias-tied-bf16": _cfg(
        "olmo2",
        num_hidden_layers=2,
        attention_bias=True,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "olmo3-bias-tied-yarn-bf16": _cfg(
        "olmo3",
        num_hidden_layers=2,
        attention_bias=True,
        tie_word_embeddings=True,
        layer_types=["full_attention", "sliding_attention"],
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.2,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=512,
        torch_dtype="bfloat16",
    ),
    "gemma3_text": _cfg(
        "gemma3_text", num_hidden_layers=7, head_dim=8, sliding_window=3, query_pre_attn_scalar=6
    ),
    "gemma3_text-untied-bias-linear-rope-bf16": _cfg(
        "gemma3_text",
        num_hidden_layers=3,
        head_dim=6,
        attention_bias=True,
        tie_word_embeddings=False,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=1000.0,
        torch_dtype="bfloat16",
    ),
    "minimax_m2": _cfg(
        "minimax_m2",
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        rotary_dim=4,
        use_qk_norm=True,
        qk_norm_type="per_layer",
        scoring_func="sigmoid",
    ),
    "minimax_m2-tied-full-rotary-bf16": _cfg(
        "minimax_m2",
        num_hidden_layers=2,
        head_dim=6,
        num_local_experts=3,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "qwen3_moe-sparse2-mlp-only": _cfg(
        "qwen3_moe",
        num_hidden_layers=6,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=True,
    ),
    "qwen3_moe-tied-local-experts": _cfg(
        "qwen3_moe",
        num_hidden_layers=2,
        num_local_experts=3,
        num_experts_per_tok=3,
        moe_intermediate_size=4,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_spec_matches_transformers_and_save_pretrained(name: str, tmp_path: Path) -> None:
    _check_model(CASES[name], tmp_path)


def test_sharded_checkpoint_moe(tmp_path: Path) -> None:
    """Several shards plus an index: the union of files is still the canonical set."""
    _check_model(CASES["qwen3_moe-sparse2-mlp-only"], tmp_path, shard="4KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1


def test_moe_layer_pattern_matches_transformers() -> None:
    cfg = CASES["qwen3_moe-sparse2-mlp-only"]
    spec = model_from_hf_config(cfg)
    model = _build(cfg, meta=True)
    real = tuple(
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers
    )
    assert spec.moe_layers == real == (False, True, False, False, False, True)


@settings(max_examples=25)
@given(cfg=hf_configs())
def test_random_configs_match_transformers(cfg: dict[str, object]) -> None:
    spec = model_from_hf_config(cfg)
    model = _build(cfg, meta=True)
    assert [(m.name, m.shape) for m in hf_memory_view(spec)] == [
        (k, tuple(v.shape)) for k, v in model.state_dict().items()
    ]
    assert spec.num_params == _canonical_numel(model)
    # our own hf_config() builds the same model
    again = _build(spec.hf_config(), meta=True)
    assert [(k, v.shape) for k, v in again.state_dict().items()] == [
        (k, v.shape) for k, v in model.state_dict().items()
    ]


@settings(max_examples=10)
@given(
    cfg=st.sampled_from(SLIDING_FAMILY_NAMES).flatmap(
        lambda f: hf_configs(f) | hf_configs(f).flatmap(gpt_oss_layer_types)
    )
)
def test_sliding_layers_match_transformers(cfg: dict[str, object]) -> None:
    """The layers transformers gives a window are the spec's sliding layers (explicit
    ``layer_types`` or each family's default pattern)."""
    spec = model_from_hf_config(cfg)
    model = _build(cfg, meta=True)
    windows = tuple(layer.self_attn.sliding_window for layer in model.model.layers)
    assert windows == tuple(spec.sliding_window if s else None for s in spec.sliding_layers)


@settings(max_examples=10, deadline=None)
@given(cfg=st.sampled_from(["olmo3", "gemma3_text"]).flatmap(hf_configs))
def test_layer_rope_and_attention_scale_match_transformers(cfg: dict[str, object]) -> None:
    """Each layer type's rope base (Gemma 3: rope_local_base_freq on sliding layers) and
    the attention scale (Gemma 3: query_pre_attn_scalar ** -0.5) are the spec's, in the
    model transformers builds from the config and from ``hf_config()``."""
    spec = model_from_hf_config(cfg)
    d = spec.head_dim
    for built in (_build(cfg), _build(spec.hf_config())):
        rope = built.model.rotary_emb
        for sliding in set(spec.sliding_layers):  # the layer types the model has
            kind = "sliding_attention" if sliding else "full_attention"
            base = spec.rope_local_theta or spec.rope_theta if sliding else spec.rope_theta
            want = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            assert torch.equal(getattr(rope, f"{kind}_inv_freq"), want)
        scale = (spec.query_pre_attn_scalar or d) ** -0.5
        assert all(layer.self_attn.scaling == scale for layer in built.model.layers)


@settings(max_examples=10, deadline=None)
@given(cfg=st.sampled_from(["glm4_moe", "minimax_m2"]).flatmap(hf_configs))
def test_partial_rotary_matches_transformers(cfg: dict[str, object]) -> None:
    """The rotated dims (``partial_rotary_factor``, or MiniMax-M2's ``rotary_dim``) are
    the spec's: transformers' rope frequencies from the config and from ``hf_config()``
    are the same, ``rotary_fraction * head_dim / 2`` of them."""
    spec = model_from_hf_config(cfg)
    ref = _build(cfg).model.rotary_emb.inv_freq
    again = _build(spec.hf_config()).model.rotary_emb.inv_freq
    assert torch.equal(ref, again)
    assert ref.numel() == round(spec.rotary_fraction * spec.head_dim) // 2


@settings(max_examples=10)
@given(
    cfg=st.sampled_from(
        ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss", "minimax_m2"]
    ).flatmap(lambda f: hf_configs(f, max_layers=3))
)
def test_random_moe_round_trip_is_bitwise(cfg: dict[str, object]) -> None:
    spec = model_from_hf_config(cfg)
    sd = _build(cfg).state_dict()
    back = canonical_to_hf_state(hf_state_to_canonical(sd, spec), spec)
    assert list(back) == list(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.json")), ids=lambda p: p.stem)
def test_published_configs_match_transformers_on_meta(path: Path) -> None:
    """Full-size published configs: names, shapes and parameter counts of the real model."""
    cfg = json.loads(path.read_text())
    spec = model_from_hf_config(path)
    model = _build(cfg, meta=True)
    assert [(m.name, m.shape) for m in hf_memory_view(spec)] == [
        (k, tuple(v.shape)) for k, v in model.state_dict().items()
    ]
    assert spec.num_params == _canonical_numel(model)
