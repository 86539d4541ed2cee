"""Gemma 3, text (``gemma3_text``: gemma-3-1b, the text model of gemma-3-4b/12b/27b):
(1 + w) RMSNorms, four norms per layer, per-head q/k norms, a GeGLU MLP, an embedding
scaled by ``sqrt(hidden_size)``, five sliding-window layers to one global layer.

A layer holds ``self_attn.{q,k,v,o}_proj`` (biases with ``attention_bias``),
``self_attn.q_norm`` / ``k_norm`` ``[head_dim]``, ``mlp.{gate,up,down}_proj`` with
``hidden_activation`` ``gelu_pytorch_tanh``, then ``input_layernorm``,
``post_attention_layernorm`` (on the attention output), ``pre_feedforward_layernorm``
and ``post_feedforward_layernorm`` (on the MLP output). Every RMSNorm multiplies by
``1 + weight`` (weights stored around 0). The embedding is multiplied by
``sqrt(hidden_size)`` (a non-persistent buffer, not a checkpoint tensor); the output
layer is tied to it by default. Attention scores are scaled by
``query_pre_attn_scalar ** -0.5``. Layers that ``layer_types`` marks
``sliding_attention`` (default: all but every ``sliding_window_pattern``-th, 6) attend
to the last ``sliding_window`` tokens and rotate with base ``rope_local_base_freq``;
the global layers with ``rope_theta`` and the rope scaling (linear, factor 8, in the
4b/12b/27b configs). Logit soft-capping and bidirectional attention are refused (the
published configs have none, and the engines' attention does not apply them).

Megatron-Core 0.16's ``GPTModel`` cannot express it: no norm on the attention or MLP
output, no embedding scale, no second rope base for the sliding layers, and its CPU
(torch) RMSNorm refuses ``layernorm_zero_centered_gamma``, the ``1 + w`` form.
"""

from areal_fn.model.families import CORE_KEYS, Family
from areal_fn.model.families.mapping import GQA_ATTENTION_HF, SWIGLU_MLP_HF, Dim, HfTensor

#: The four norms of a sandwich-norm layer, last in the state dict.
SANDWICH_NORMS_HF: tuple[HfTensor, ...] = tuple(
    HfTensor(name=f"{n}.weight", shape=(Dim.HIDDEN,))
    for n in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )
)

FAMILY = Family(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SWIGLU_MLP_HF, *SANDWICH_NORMS_HF),
    megatron=(),
    required=CORE_KEYS,
    defaults=(
        ("num_key_value_heads", 4),
        ("head_dim", 256),  # the config class's default, not hidden_size // heads
        ("tie_word_embeddings", True),
        ("attention_bias", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 1000000.0),
        ("rope_local_base_freq", 10000.0),
        ("max_position_embeddings", 131072),
        ("sliding_window", 4096),
        ("sliding_window_pattern", 6),
        ("query_pre_attn_scalar", 256),
    ),
    bias_flags=(("attention_bias", ("qkv_bias", "o_bias")),),
    fixed=(("mlp_bias", False), ("qk_norm", True)),
    hidden_divisible_by_heads=True,
    hidden_act="gelu_pytorch_tanh",
    act_key="hidden_activation",
    must_be=(
        ("final_logit_softcapping", None),
        ("attn_logit_softcapping", None),
        ("use_bidirectional_attention", False),
    ),
    sliding_window="layer_types",
    sliding_every=6,
    sliding_every_key="sliding_window_pattern",
    layer_rope=True,
    attn_scalar=True,
    megatron_refusal=(
        "Megatron-Core 0.16's GPTModel cannot express gemma3_text: its layer has no norm on "
        "the attention and MLP outputs, its embedding has no sqrt(hidden_size) scale, it "
        "rotates every layer with one rope base (gemma3_text's sliding layers have their "
        "own), and its CPU RMSNorm refuses the (1 + w) form (layernorm_zero_centered_gamma); "
        "use the fsdp backend"
    ),
)
