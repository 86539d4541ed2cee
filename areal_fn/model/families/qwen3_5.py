"""Qwen3.5, the text model (``qwen3_5_text``: Qwen3.5-27B; ``qwen3_5_moe_text``:
Qwen3.5-35B-A3B): Qwen3-Next's layers with the linear-attention projections split.

A published Qwen3.5 ``config.json`` is multimodal (``model_type`` ``qwen3_5`` or
``qwen3_5_moe``, a vision tower beside the text model); its ``text_config`` is read
(:data:`~areal_fn.model.families.TEXT_CONFIG_TYPES`), and the spec is the text model
transformers builds from it (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``), whose
``save_pretrained`` names its tensors ``model.layers.{i}...`` (the published
checkpoints hold them under ``model.language_model.``, beside ``model.visual.*`` and
``mtp.*``). The multimodal rope keys (``mrope_section``, ``mrope_interleaved``) change
nothing for text, where every position axis holds the same position, and are not kept.

A linear-attention layer holds ``linear_attn.{dt_bias, A_log}``, ``conv1d``, ``norm``,
``out_proj``, then ``in_proj_qkv`` (``[q; k; v]``, all heads of each in turn),
``in_proj_z``, ``in_proj_b`` and ``in_proj_a``. Full attention is Qwen3-Next's gated
attention (:mod:`~areal_fn.model.families.qwen3_next`). The dense model has a SwiGLU MLP
in every layer; the MoE model routed experts (softmax top-k, always renormalised) and the
gated shared expert in every layer. Where it runs: as Qwen3-Next.
"""

from areal_fn.model.families import SOFTMAX_ROUTING, STACKED_SWIGLU_EXPERTS, Family
from areal_fn.model.families.mapping import (
    LAYER_NORMS_HF,
    SWIGLU_MLP,
    SWIGLU_MLP_HF,
    Dim,
    Fusion,
    HfTensor,
)
from areal_fn.model.families.mixer import Mixer
from areal_fn.model.families.qwen3_next import (
    GATED_ATTENTION,
    GATED_ATTENTION_HF,
    GATED_SHARED_MOE_HF,
    LINEAR_DEFAULTS,
    LINEAR_MOE_MLP,
    LINEAR_TAIL_HF,
    MEGATRON_GATED_DELTA,
    SEQUENCE_REFUSAL,
    gated_delta_net,
    linear_params_hf,
)
from areal_fn.model.families.tp_role import TpRole

#: Qwen3.5's gated delta net: the projections split (``in_proj_qkv``, ``_z``, ``_b``, ``_a``).
SPLIT_GATED_DELTA_NET_HF: tuple[HfTensor, ...] = (
    *linear_params_hf(),
    *LINEAR_TAIL_HF,
    *(
        HfTensor(name=f"linear_attn.{n}.weight", shape=(d, Dim.HIDDEN), mixer=Mixer.LINEAR, tp=tp)
        for n, d, tp in (
            ("in_proj_qkv", Dim.LIN_QKV, TpRole.DELTA_QKV),
            ("in_proj_z", Dim.LIN_V, TpRole.COLUMN),  # by value head
            ("in_proj_b", Dim.LIN_V_HEADS, TpRole.COLUMN),
            ("in_proj_a", Dim.LIN_V_HEADS, TpRole.COLUMN),
        )
    ),
)

#: Megatron-Core's GatedDeltaNet from the split projections (``Fusion.GDN_IN_PROJ_SPLIT``).
SPLIT_GATED_DELTA_NET = gated_delta_net(
    tuple(f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")), Fusion.GDN_IN_PROJ_SPLIT
)

_MROPE = ("mrope_section", "mrope_interleaved")
_FIXED = (("qkv_bias", False), ("o_bias", False), ("mlp_bias", False), ("qk_norm", True))
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

FAMILY = Family(
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    canonical=(*GATED_ATTENTION_HF, *SPLIT_GATED_DELTA_NET_HF, *SWIGLU_MLP_HF, *LAYER_NORMS_HF),
    megatron=(*GATED_ATTENTION, *SPLIT_GATED_DELTA_NET, *SWIGLU_MLP),
    required=_REQUIRED,
    defaults=(
        *((k, 4 if k == "num_key_value_heads" else v) for k, v in LINEAR_DEFAULTS),
        ("intermediate_size", 12288),
    ),
    bias_flags=(),
    fixed=_FIXED,
    partial_rotary=True,
    linear_attention=True,
    must_be=(("attention_bias", False),),
    ignored_rope_keys=_MROPE,
    serving=MEGATRON_GATED_DELTA,
    sequence_refusal=SEQUENCE_REFUSAL.format(mt="qwen3_5_text"),
)

MOE_FAMILY = Family(
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    canonical=(
        *GATED_ATTENTION_HF,
        *SPLIT_GATED_DELTA_NET_HF,
        *GATED_SHARED_MOE_HF,
        *LAYER_NORMS_HF,
    ),
    megatron=(*GATED_ATTENTION, *SPLIT_GATED_DELTA_NET, *LINEAR_MOE_MLP),
    required=_REQUIRED,
    defaults=(
        *LINEAR_DEFAULTS,
        ("num_experts", 256),
        ("num_experts_per_tok", 8),
        ("moe_intermediate_size", 512),
        ("shared_expert_intermediate_size", 512),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
    ),
    bias_flags=(),
    fixed=(*_FIXED, ("norm_topk_prob", True), *SOFTMAX_ROUTING),
    moe=True,
    fused_experts=STACKED_SWIGLU_EXPERTS,
    partial_rotary=True,
    linear_attention=True,
    # no dense MLP: intermediate_size is the experts' width, a key the class lacks
    key_sources=(("intermediate_size", "moe_intermediate_size"),),
    foreign_keys=(
        ("intermediate_size", "moe_intermediate_size (every layer is MoE)"),
        ("decoder_sparse_step", "nothing: every layer is MoE"),
        ("norm_topk_prob", "nothing: the router always renormalises its top-k"),
        ("num_local_experts", "num_experts"),
    ),
    must_be=(("attention_bias", False),),
    ignored_rope_keys=_MROPE,
    serving=MEGATRON_GATED_DELTA,
    sequence_refusal=SEQUENCE_REFUSAL.format(mt="qwen3_5_moe_text"),
)
