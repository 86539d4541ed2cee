"""The size of each named model dimension and the value of each table condition for a
:class:`~areal_fn.model.spec.ModelSpec`: what the family tables
(:mod:`areal_fn.model.families.mapping`) are interpreted with."""

from typing import Any

from areal_fn.model import linear_attention as lin
from areal_fn.model.families.mapping import CONDITIONS, Dim


def dim_sizes(spec: Any) -> dict[Dim, int]:
    """The size of every :class:`~areal_fn.model.families.mapping.Dim` for ``spec``."""
    hd = spec.head_dim
    return {
        Dim.HIDDEN: spec.hidden_size,
        Dim.HEAD_DIM: hd,
        Dim.HEADS: spec.num_attention_heads,
        Dim.Q_OUT: spec.num_attention_heads * hd,
        Dim.KV_OUT: spec.num_key_value_heads * hd,
        Dim.INTER: spec.intermediate_size,
        Dim.MOE_INTER: spec.moe_intermediate_size,
        Dim.GLU_INTER: 2 * spec.moe_intermediate_size,
        Dim.EXPERTS: spec.num_experts,
        Dim.SHARED_INTER: spec.num_shared_experts * spec.moe_intermediate_size,
        Dim.Q_LORA: spec.q_lora_rank,
        Dim.KV_LORA: spec.kv_lora_rank,
        Dim.KV_A_OUT: spec.kv_lora_rank + spec.qk_rope_head_dim,
        Dim.KV_B_OUT: spec.num_attention_heads * (spec.qk_nope_head_dim + spec.v_head_dim),
        Dim.V_OUT: spec.num_attention_heads * spec.v_head_dim,
        **lin.linear_sizes(spec),
        Dim.INDEX_HEAD_DIM: spec.index_head_dim,
        Dim.INDEX_HEADS: spec.index_n_heads,
        Dim.INDEX_Q_OUT: spec.index_n_heads * spec.index_head_dim,
    }


def condition_flags(spec: Any) -> dict[str, object]:
    """The value of every table condition (``when``) for ``spec``."""
    return {c: getattr(spec, c) for c in CONDITIONS}
