"""DeepSeek-V3.2 / GLM-5 configs the DSA families refuse, each with its message pinned."""

import re

import pytest

from areal_fn import fsdp2_layout, megatron_layout, model_from_hf_config
from areal_fn.errors import LayoutError, SpecError, UnsupportedConfigError

_BASE: dict[str, object] = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "v_head_dim": 4,
    "vocab_size": 32,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 4,
}


def _cfg(model_type: str = "deepseek_v32", **kw: object) -> dict[str, object]:
    return {"model_type": model_type, **_BASE, **kw}


CASES = [
    (
        "rope_interleave false",
        _cfg(rope_interleave=False),
        UnsupportedConfigError,
        "deepseek_v32 config has rope_interleave=False; the deepseek_v32 family models "
        "rope_interleave=True only",
    ),
    (
        "sliding layer kind",
        _cfg(layer_types=["indexed_attention", "sliding_attention", "indexed_attention"]),
        UnsupportedConfigError,
        "deepseek_v32 config has layer_types=.*models 'indexed_attention' layers only",
    ),
    (
        "mlp_layer_types against first_k_dense_replace",
        _cfg(mlp_layer_types=["dense", "dense", "sparse"]),
        SpecError,
        r"mlp_layer_types=\['dense', 'dense', 'sparse'\] disagrees with "
        r"first_k_dense_replace=1, which gives \['dense', 'sparse', 'sparse'\]",
    ),
    (
        "layer 0 shared",
        _cfg("glm_moe_dsa", indexer_types=["shared", "full", "full"]),
        SpecError,
        "glm_moe_dsa: layer 0's indexer is 'shared'.*make layer 0 'full'",
    ),
    (
        "layer 0 shared by the offset rule",
        _cfg("glm_moe_dsa", index_topk_freq=2, index_skip_topk_offset=0),
        SpecError,
        "glm_moe_dsa: layer 0's indexer is 'shared'",
    ),
    (
        "indexer_types value",
        _cfg("glm_moe_dsa", indexer_types=["full", "dense", "full"]),
        SpecError,
        "indexer_types has 'dense'; each layer's indexer is 'full'",
    ),
    (
        "indexer_types length",
        _cfg("glm_moe_dsa", indexer_types=["full", "shared"]),
        SpecError,
        r"indexer_types=\['full', 'shared'\] must be a list of 'full'/'shared', one per "
        r"layer \(num_hidden_layers=3\)",
    ),
    (
        "indexer narrower than the rope dims",
        _cfg(index_head_dim=2),
        SpecError,
        "deepseek_v32: index_head_dim=2 is below qk_rope_head_dim=4",
    ),
    (
        "no query LoRA",
        _cfg(q_lora_rank=None),
        SpecError,
        "deepseek_v32: q_lora_rank=0; the indexer's wq_b reads the query LoRA's latent",
    ),
    (
        "kv heads left at the class default",
        {k: v for k, v in _cfg().items() if k != "num_key_value_heads"},
        SpecError,
        "num_key_value_heads=128 does not divide num_attention_heads=2",
    ),
]


@pytest.mark.parametrize(
    ("cfg", "error", "regex"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_refused(cfg: dict[str, object], error: type[Exception], regex: str) -> None:
    with pytest.raises(error, match=regex):
        model_from_hf_config(cfg)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_megatron_layout_refused_with_the_reason(model_type: str) -> None:
    spec = model_from_hf_config(_cfg(model_type))
    with pytest.raises(LayoutError, match=re.escape(spec.family.megatron_refusal)):
        megatron_layout(spec, "megatron:t2")


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sequence_split_refused_with_the_reason(model_type: str) -> None:
    """Ulysses would give the indexer one rank's shard of the keys."""
    spec = model_from_hf_config(_cfg(model_type))
    with pytest.raises(
        LayoutError, match=f"cp=2: {model_type}'s indexer \\(transformers\\) scores every key"
    ):
        fsdp2_layout(spec, "fsdp:d2c2")
