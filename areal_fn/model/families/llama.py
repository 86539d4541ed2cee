"""Llama (Llama 3.x): GQA, optional attention/MLP biases, tied or untied embeddings.

transformers' ``LlamaConfig`` rejects ``hidden_size % num_attention_heads != 0`` even
when ``head_dim`` is explicit, so this family checks it too.
"""

from areal_fn.model.families import CORE_KEYS, Family
from areal_fn.model.families.mapping import (
    GQA_ATTENTION,
    GQA_ATTENTION_HF,
    LAYER_NORMS_HF,
    SWIGLU_MLP,
    SWIGLU_MLP_HF,
)
from areal_fn.model.families.serving import Serving, TiedRefusal

FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SWIGLU_MLP_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SWIGLU_MLP),
    required=CORE_KEYS,
    defaults=(
        ("num_key_value_heads", None),  # None -> num_attention_heads
        ("head_dim", None),  # None -> hidden_size // num_attention_heads
        ("tie_word_embeddings", False),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 2048),
    ),
    bias_flags=(
        ("attention_bias", ("qkv_bias", "o_bias")),
        ("mlp_bias", ("mlp_bias",)),
    ),
    fixed=(("qk_norm", False),),
    hidden_divisible_by_heads=True,
    serving=Serving(
        vllm_layout=True,
        tied_refusals=(
            TiedRefusal(
                engine="sglang",
                pp_only=True,
                reason="SGLang's LlamaForCausalLM cannot serve a model with "
                "tie_word_embeddings at pp={pp}: it uses model.embed_tokens as lm_head, and "
                "embed_tokens exists on the first pipeline rank only "
                "(sglang/srt/models/llama.py); use pp=1, vllm, or an untied model",
            ),
        ),
    ),
)
