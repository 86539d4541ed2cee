"""The model dimensions a canonical tensor's shape is written in (:class:`Dim`).

Re-exported by :mod:`areal_fn.model.families.mapping`, where the tables use it.
"""

import enum


class Dim(enum.Enum):
    """A model dimension a canonical shape is written in (its value: how ModelSpec gives it)."""

    HIDDEN = "hidden_size"
    HEAD_DIM = "head_dim"
    #: ``num_attention_heads`` (gpt-oss attention sinks: one per head).
    HEADS = "num_attention_heads"
    #: ``num_attention_heads * head_dim``.
    Q_OUT = "num_attention_heads * head_dim"
    #: ``num_key_value_heads * head_dim``.
    KV_OUT = "num_key_value_heads * head_dim"
    INTER = "intermediate_size"
    MOE_INTER = "moe_intermediate_size"
    #: ``2 * moe_intermediate_size``: gate and up of one expert side by side (gpt-oss).
    GLU_INTER = "2 * moe_intermediate_size"
    EXPERTS = "num_experts"
    #: ``num_shared_experts * moe_intermediate_size``: the shared experts' fused width.
    SHARED_INTER = "num_shared_experts * moe_intermediate_size"
    #: ``2 * num_attention_heads * head_dim``: per head ``[q_h; gate_h]`` (gated attention output).
    GATED_Q_OUT = "2 * num_attention_heads * head_dim"
    #: The gated shared expert's width (``shared_expert_intermediate_size``).
    SHARED_EXPERT = "shared_expert_size"
    ONE = "1"
    #: Gated delta net (:class:`~areal_fn.model.linear_attention.LinearAttention`).
    LIN_QKVZ = "2 * key_dim + 2 * value_dim"
    LIN_QKV = "2 * key_dim + value_dim"
    LIN_V = "value_dim"
    LIN_V_HEADS = "value_heads"
    LIN_BA = "2 * value_heads"
    LIN_V_HEAD_DIM = "value_head_dim"
    LIN_CONV = "conv_kernel"
    #: Multi-latent attention: the query and key/value LoRA ranks.
    Q_LORA = "q_lora_rank"
    KV_LORA = "kv_lora_rank"
    #: ``kv_lora_rank + qk_rope_head_dim``: the compressed key/value plus the shared rope key.
    KV_A_OUT = "kv_lora_rank + qk_rope_head_dim"
    #: ``num_attention_heads * (qk_nope_head_dim + v_head_dim)``: per head ``[k_nope; v]``.
    KV_B_OUT = "num_attention_heads * (qk_nope_head_dim + v_head_dim)"
    #: ``num_attention_heads * v_head_dim``: the attention output's width.
    V_OUT = "num_attention_heads * v_head_dim"
    INDEX_HEAD_DIM = "index_head_dim"
    INDEX_HEADS = "index_n_heads"
    INDEX_Q_OUT = "index_n_heads * index_head_dim"

    def __repr__(self) -> str:
        return f"Dim.{self.name}"
