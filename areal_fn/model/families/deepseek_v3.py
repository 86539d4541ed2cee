"""DeepSeek-V3 / DeepSeek-R1 / Kimi-K2 (``deepseek_v3``): multi-latent attention
(:mod:`areal_fn.model.mla`), ``first_k_dense_replace`` dense layers, then MoE layers
with a sigmoid router, a score-correction bias, group-limited top-k and shared experts
(the same MoE block as GLM-4.5).

An attention layer holds ``self_attn.q_a_proj`` ``[q_lora_rank, H]``,
``q_a_layernorm`` ``[q_lora_rank]``, ``q_b_proj`` ``[heads * qk_head_dim, q_lora_rank]``
(or ``q_proj`` ``[heads * qk_head_dim, H]`` when ``q_lora_rank`` is null),
``kv_a_proj_with_mqa`` ``[kv_lora_rank + qk_rope_head_dim, H]``, ``kv_a_layernorm``
``[kv_lora_rank]``, ``kv_b_proj`` ``[heads * (qk_nope_head_dim + v_head_dim),
kv_lora_rank]`` and ``o_proj`` ``[H, heads * v_head_dim]``. Megatron-Core's
``MLASelfAttention`` copies each whole: under its local spec every projection but
``linear_proj`` is column-parallel (``Shard(0)``; the down projections are gathered
after), under the Transformer-Engine spec the down projections are replicated and the
q/kv layer norms are fused into the up projections. Megatron's MLA applies rotary
embeddings to de-interleaved dims, which is what transformers computes with
``rope_interleave=true`` (the default and every published config); with
``rope_interleave=false`` the rope rows of the q and kv_a projections are laid
interleaved in Megatron's parameters (``Fusion.MLA_Q``, ``Fusion.MLA_KV_A``), so that
its de-interleave gives transformers' rotate-half order.

Multi-token-prediction layers (``num_nextn_predict_layers``) are not part of the model
transformers builds or ``save_pretrained`` writes; they are canonical tensors when the
spec is read with ``mtp=True`` (:mod:`areal_fn.model.mtp`), and otherwise a checkpoint
that holds them (``model.layers.{num_hidden_layers}.*``) is refused by the strict
readers, which list them as unexpected, not dropped.
"""

from areal_fn.model.families import CORE_KEYS, STACKED_SWIGLU_EXPERTS, Family
from areal_fn.model.families.glm4_moe import (
    DEEPSEEK_MOE_FOREIGN_KEYS,
    DEEPSEEK_MOE_KEYS,
    DEEPSEEK_MOE_LAYER,
    DEEPSEEK_MOE_LAYER_HF,
)
from areal_fn.model.families.mapping import (
    Dim,
    Fusion,
    HfTensor,
    MegatronTensor,
)
from areal_fn.model.families.serving import MtpBlock
from areal_fn.model.families.tp_role import TpRole
from areal_fn.sharding.placement import Replicate, Shard

_ROWS, _COLS = Shard(dim=0), Shard(dim=1)
_R = TpRole.REPLICATE


def _attn(name: str, *shape: Dim, when: str | None = None, tp: TpRole = _R) -> HfTensor:
    return HfTensor(name=f"self_attn.{name}.weight", shape=shape, when=when, tp=tp)


#: Canonical tensors of multi-latent attention, in transformers' registration order.
MLA_ATTENTION_HF: tuple[HfTensor, ...] = (
    _attn("q_proj", Dim.Q_OUT, Dim.HIDDEN, when="q_direct", tp=TpRole.COLUMN),
    _attn("q_a_proj", Dim.Q_LORA, Dim.HIDDEN, when="q_lora_rank"),
    _attn("q_a_layernorm", Dim.Q_LORA, when="q_lora_rank"),
    _attn("q_b_proj", Dim.Q_OUT, Dim.Q_LORA, when="q_lora_rank", tp=TpRole.COLUMN),
    _attn("kv_a_proj_with_mqa", Dim.KV_A_OUT, Dim.HIDDEN, tp=TpRole.SHARED_ROPE_KEY),
    _attn("kv_a_layernorm", Dim.KV_LORA),
    _attn("kv_b_proj", Dim.KV_B_OUT, Dim.KV_LORA, tp=TpRole.COLUMN),
    _attn("o_proj", Dim.HIDDEN, Dim.V_OUT, tp=TpRole.ROW),
)


def _mla(
    local: str,
    hf: str,
    tp: Shard | Replicate,
    *,
    te: str | None = None,
    te_tp: Shard | Replicate | None = None,
    when: str | None = None,
    fusion: Fusion = Fusion.WHOLE,
) -> MegatronTensor:
    return MegatronTensor(
        local=f"self_attention.{local}",
        te=None if te is None else f"self_attention.{te}",
        hf=f"self_attn.{hf}.weight",
        tp=tp,
        te_tp=te_tp,
        when=when,
        fusion=fusion,
    )


#: Megatron-Core's ``MLASelfAttention`` (local spec names; TE names and placements where
#: they differ).
MLA_ATTENTION: tuple[MegatronTensor, ...] = (
    MegatronTensor(local="input_layernorm.weight", hf="input_layernorm.weight", tp=Replicate()),
    _mla("linear_q_proj.weight", "q_proj", _ROWS, when="q_direct", fusion=Fusion.MLA_Q),
    _mla("linear_q_down_proj.weight", "q_a_proj", _ROWS, te_tp=Replicate(), when="q_lora_rank"),
    _mla(
        "q_layernorm.weight",
        "q_a_layernorm",
        Replicate(),
        te="linear_q_up_proj.layer_norm_weight",
        when="q_lora_rank",
    ),
    _mla("linear_q_up_proj.weight", "q_b_proj", _ROWS, when="q_lora_rank", fusion=Fusion.MLA_Q),
    _mla(
        "linear_kv_down_proj.weight",
        "kv_a_proj_with_mqa",
        _ROWS,
        te_tp=Replicate(),
        fusion=Fusion.MLA_KV_A,
    ),
    _mla(
        "kv_layernorm.weight",
        "kv_a_layernorm",
        Replicate(),
        te="linear_kv_up_proj.layer_norm_weight",
    ),
    _mla("linear_kv_up_proj.weight", "kv_b_proj", _ROWS),
    _mla("linear_proj.weight", "o_proj", _COLS),
)

FAMILY = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    canonical=(*MLA_ATTENTION_HF, *DEEPSEEK_MOE_LAYER_HF),
    megatron=(*MLA_ATTENTION, *DEEPSEEK_MOE_LAYER),
    required=(
        *CORE_KEYS,
        "moe_intermediate_size",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    ),
    defaults=(
        ("num_key_value_heads", None),  # None -> num_attention_heads
        ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 4096),
        ("q_lora_rank", 1536),
        ("rope_interleave", True),
        ("n_routed_experts", 256),
        ("num_experts_per_tok", 8),
        ("n_shared_experts", 1),
        ("routed_scaling_factor", 2.5),
        ("n_group", 8),
        ("topk_group", 4),
        ("first_k_dense_replace", 3),
        ("num_nextn_predict_layers", 1),
        ("norm_topk_prob", True),
    ),
    bias_flags=(),
    fixed=(
        ("qkv_bias", False),
        ("o_bias", False),
        ("mlp_bias", False),
        ("qk_norm", False),
        ("router_score", "sigmoid"),
        ("router_bias", True),
    ),
    must_be=(("attention_bias", False),),
    moe=True,
    mla=True,
    first_k_dense="first_k_dense_replace",
    mtp=MtpBlock(),
    key_sources=(("num_experts", "n_routed_experts"),),
    foreign_keys=DEEPSEEK_MOE_FOREIGN_KEYS,
    moe_keys=DEEPSEEK_MOE_KEYS,
    fused_experts=STACKED_SWIGLU_EXPERTS,
)
