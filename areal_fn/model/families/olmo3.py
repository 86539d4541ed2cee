"""OLMo 3 (``olmo3``: Olmo-3-1025-7B, Olmo-3-32B): post-norm decoder layers, q/k norms
over the whole projection, sliding-window attention on three layers of four.

A layer holds ``self_attn.{q,k,v,o}_proj`` (biases with ``attention_bias``),
``self_attn.q_norm`` ``[heads*head_dim]`` and ``self_attn.k_norm``
``[kv_heads*head_dim]`` (RMSNorm over the whole q and k projections, before they are
split into heads), a SwiGLU MLP, and two RMSNorms applied to the *outputs* of the
attention and the MLP before each residual add: ``post_attention_layernorm`` and
``post_feedforward_layernorm``. There is no input norm. Layers that ``layer_types``
marks ``sliding_attention`` (default: every layer but each fourth) attend to the last
``sliding_window`` tokens; rope scaling (YaRN in the published configs) applies to the
full-attention layers only, the sliding ones rotate with plain rope of the same base.

Megatron-Core 0.16's ``GPTModel`` cannot express it: its layer has no norm on the
attention or MLP output (``TransformerLayerSubmodules`` holds ``input_layernorm`` and
``pre_mlp_layernorm`` only) and its ``q_layernorm`` normalises each head, not the whole
projection. The FSDP2 engine runs it without tensor parallelism: a norm over the whole
projection needs every head of a token, which a column-parallel ``q_proj`` splits.
"""

from areal_fn.model.families import Family
from areal_fn.model.families.mapping import GQA_ATTENTION_HF, SWIGLU_MLP_HF, Dim, HfTensor

#: q/k/v/o projections, then RMSNorms over the whole q and k projections.
FULL_QK_NORM_ATTENTION_HF: tuple[HfTensor, ...] = (
    *(r for r in GQA_ATTENTION_HF if "_norm." not in r.name),
    HfTensor(name="self_attn.q_norm.weight", shape=(Dim.Q_OUT,), when="qk_norm"),
    HfTensor(name="self_attn.k_norm.weight", shape=(Dim.KV_OUT,), when="qk_norm"),
)

#: The norms on the attention and MLP outputs, last in the state dict.
POST_NORMS_HF: tuple[HfTensor, ...] = (
    HfTensor(name="post_attention_layernorm.weight", shape=(Dim.HIDDEN,)),
    HfTensor(name="post_feedforward_layernorm.weight", shape=(Dim.HIDDEN,)),
)

FAMILY = Family(
    model_type="olmo3",
    architecture="Olmo3ForCausalLM",
    canonical=(*FULL_QK_NORM_ATTENTION_HF, *SWIGLU_MLP_HF, *POST_NORMS_HF),
    megatron=(),
    required=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    ),
    defaults=(
        ("tie_word_embeddings", False),
        ("attention_bias", False),
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 500000.0),
        ("max_position_embeddings", 2048),
        ("sliding_window", 4096),
    ),
    bias_flags=(("attention_bias", ("qkv_bias", "o_bias")),),
    fixed=(("mlp_bias", False), ("qk_norm", True)),
    sliding_window="layer_types",
    sliding_every=4,
    layer_rope=True,
    megatron_refusal=(
        "Megatron-Core 0.16's GPTModel cannot express olmo3: its layer has no norm on the "
        "attention and MLP outputs (post_attention_layernorm, post_feedforward_layernorm) and "
        "its q_layernorm normalises each head, not the whole q/k projection; use the fsdp "
        "backend"
    ),
    fsdp2_tp_refusal=(
        "olmo3's q_norm/k_norm normalise the whole q and k projections, which column-wise "
        "TP splits by heads (the FSDP2 engine would norm each rank's heads alone)"
    ),
)
