"""OLMo 2 (``olmo2``: OLMo-2-0425-1B, OLMo-2-1124-7B/13B, OLMo-2-0325-32B): OLMo 3's
decoder layer with full attention in every layer.

A layer holds ``self_attn.{q,k,v,o}_proj`` (biases with ``attention_bias``), RMSNorms
``self_attn.q_norm`` ``[heads*head_dim]`` and ``self_attn.k_norm`` ``[kv_heads*head_dim]``
over the whole q and k projections, a SwiGLU MLP and two RMSNorms on the *outputs* of the
attention and the MLP (``post_attention_layernorm``, ``post_feedforward_layernorm``);
no input norm, no sliding window.

Megatron-Core 0.16's ``GPTModel`` cannot express it, for OLMo 3's reasons; the FSDP2
engine runs it without tensor parallelism (a norm over the whole projection needs every
head of a token).
"""

from areal_fn.model.families import Family
from areal_fn.model.families.mapping import SWIGLU_MLP_HF
from areal_fn.model.families.olmo3 import FAMILY as OLMO3
from areal_fn.model.families.olmo3 import FULL_QK_NORM_ATTENTION_HF, POST_NORMS_HF

FAMILY = Family(
    model_type="olmo2",
    architecture="Olmo2ForCausalLM",
    canonical=(*FULL_QK_NORM_ATTENTION_HF, *SWIGLU_MLP_HF, *POST_NORMS_HF),
    megatron=(),
    required=OLMO3.required,
    defaults=(
        ("tie_word_embeddings", False),
        ("attention_bias", False),
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 2048),
    ),
    bias_flags=OLMO3.bias_flags,
    fixed=OLMO3.fixed,
    megatron_refusal=(
        "Megatron-Core 0.16's GPTModel cannot express olmo2: its layer has no norm on the "
        "attention and MLP outputs (post_attention_layernorm, post_feedforward_layernorm) and "
        "its q_layernorm normalises each head, not the whole q/k projection; use the fsdp "
        "backend"
    ),
    fsdp2_tp_refusal=(
        "olmo2's q_norm/k_norm normalise the whole q and k projections, which column-wise "
        "TP splits by heads (the FSDP2 engine would norm each rank's heads alone)"
    ),
)
