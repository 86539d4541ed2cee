"""Tiny configs of the gated-delta-net families, shared by the FSDP2 oracle and the
gradient workers: three linear-attention layers and one gated full-attention layer
(``layer_types`` explicit, the full layer second), float32; Qwen3-Next and Qwen3.5-MoE
with routed experts and the gated shared expert (expert widths of 8 floats: transformers'
grouped GEMM wants 16-byte strides)."""

_BASE: dict[str, object] = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 52,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}

_MOE: dict[str, object] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 8,
}


def qwen3_next() -> dict[str, object]:
    return {**_BASE, **_MOE, "model_type": "qwen3_next", "mlp_only_layers": [2]}


def qwen3_5_text() -> dict[str, object]:
    return {**_BASE, "model_type": "qwen3_5_text"}


def qwen3_5_moe_text() -> dict[str, object]:
    out = {**_BASE, **_MOE, "model_type": "qwen3_5_moe_text"}
    del out["intermediate_size"]
    return out
