"""Mistral (Mistral-7B, Ministral-style dense models): Llama's layer without biases.

``MistralConfig`` has no ``attention_bias`` / ``mlp_bias``; ``head_dim`` defaults to
``hidden_size // num_attention_heads``. Its ``sliding_window`` (default 4096) applies to
every layer whenever it is not null, which this family does not model: a config with a
window (Mistral-7B-v0.1) is refused; Mistral-7B-v0.3 sets it to null.
"""

from areal_fn.model.families import CORE_KEYS, Family
from areal_fn.model.families.mapping import (
    GQA_ATTENTION,
    GQA_ATTENTION_HF,
    LAYER_NORMS_HF,
    SWIGLU_MLP,
    SWIGLU_MLP_HF,
)
from areal_fn.model.families.serving import Serving

FAMILY = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SWIGLU_MLP_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SWIGLU_MLP),
    required=CORE_KEYS,
    defaults=(
        ("num_key_value_heads", 8),
        ("head_dim", None),  # None -> hidden_size // num_attention_heads
        ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 131072),
        ("sliding_window", 4096),
    ),
    bias_flags=(),
    fixed=(("qkv_bias", False), ("o_bias", False), ("mlp_bias", False), ("qk_norm", False)),
    sliding_window="when_set",
    serving=Serving(vllm_layout=True),
)
