"""Qwen3 (dense): per-head RMSNorm on q and k (``q_norm``/``k_norm``), explicit ``head_dim``.

``head_dim`` is required: transformers' ``Qwen3Config`` would silently use 128 when it is
absent, which is not ``hidden_size // num_attention_heads`` in general.
"""

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
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SWIGLU_MLP_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SWIGLU_MLP),
    required=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ),
    defaults=(
        ("tie_word_embeddings", False),
        ("attention_bias", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 32768),
        ("use_sliding_window", False),
        ("sliding_window", 4096),  # used only when use_sliding_window is true
        ("max_window_layers", 28),
    ),
    bias_flags=(("attention_bias", ("qkv_bias", "o_bias")),),
    fixed=(("mlp_bias", False), ("qk_norm", True)),
    head_dim_required=True,
    sliding_window="max_window_layers",
    serving=Serving(vllm_layout=True),
)
