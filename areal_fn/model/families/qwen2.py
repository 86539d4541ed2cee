"""Qwen2 / Qwen2.5: GQA with biases on q/k/v (always) and none on o_proj or the MLP."""

from areal_fn.model.families import Family
from areal_fn.model.families.mapping import (
    GQA_ATTENTION,
    GQA_ATTENTION_HF,
    LAYER_NORMS_HF,
    SWIGLU_MLP,
    SWIGLU_MLP_HF,
)
from areal_fn.model.families.serving import Serving

FAMILY = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SWIGLU_MLP_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SWIGLU_MLP),
    required=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ),
    defaults=(
        ("head_dim", None),  # None -> hidden_size // num_attention_heads
        ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 32768),
        ("use_sliding_window", False),
        ("sliding_window", 4096),  # used only when use_sliding_window is true
        ("max_window_layers", 28),
    ),
    bias_flags=(),
    sliding_window="max_window_layers",
    fixed=(
        ("qkv_bias", True),
        ("o_bias", False),
        ("mlp_bias", False),
        ("qk_norm", False),
    ),
    serving=Serving(vllm_layout=True),
)
