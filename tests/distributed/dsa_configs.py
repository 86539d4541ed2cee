"""Tiny configs of the DeepSeek-sparse-attention families, shared by the gradient
worker: multi-latent attention with an indexer whose top-k (3) is shorter than the
sequence, so the sparse mask selects; a dense layer then MoE layers; float32. GLM-5's
third layer reuses the second's top-k (``indexer_types``)."""

_BASE: dict[str, object] = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 52,
    "q_lora_rank": 8,
    "kv_lora_rank": 6,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "moe_intermediate_size": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "index_n_heads": 2,
    "index_head_dim": 4,
    "index_topk": 3,
    "torch_dtype": "float32",
}


def deepseek_v32() -> dict[str, object]:
    return {**_BASE, "model_type": "deepseek_v32"}


def glm_moe_dsa() -> dict[str, object]:
    return {**_BASE, "model_type": "glm_moe_dsa", "indexer_types": ["full", "full", "shared"]}
