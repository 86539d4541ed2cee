"""Tiny configs of the families with per-layer attention kinds, shared by the workers.

OLMo 3: post-norms, q/k norms over the whole projections, a ``window``-token window on
layers 0-2 of 4, YaRN on the full layer (rope nested by layer type); FSDP2 refuses it
under TP. Gemma 3 text: (1+w) norms, GeGLU, the sqrt(hidden)-scaled tied embedding, a
``window``-token window on layers 0 and 2 with their own rope base,
``query_pre_attn_scalar`` 6 (not ``head_dim``). MiniMax-M2: q/k norms over the whole
projections (FSDP2 refuses it under TP too), half of each head rotated, a sigmoid router
with a score-correction bias over 4 experts.
"""


def olmo3(window: int) -> dict[str, object]:
    return {
        "model_type": "olmo3",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 52,
        "sliding_window": window,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }


def olmo2() -> dict[str, object]:
    """OLMo 2: OLMo 3's layer (post-norms, whole-projection q/k norms) with full attention
    in every layer and plain rope."""
    return {
        "model_type": "olmo2",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 52,
        "attention_bias": True,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }


def gemma3_text(window: int) -> dict[str, object]:
    return {
        "model_type": "gemma3_text",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 52,
        "sliding_window": window,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 6,
        "rope_local_base_freq": 100.0,
        "torch_dtype": "float32",
    }


def minimax_m2() -> dict[str, object]:
    return {
        "model_type": "minimax_m2",
        "hidden_size": 16,
        "intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rotary_dim": 4,
        "vocab_size": 52,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "torch_dtype": "float32",
    }
