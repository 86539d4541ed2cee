"""How tensor parallelism splits each canonical tensor of a decoder layer: its role.

Every :class:`~areal_fn.model.families.mapping.HfTensor` of a family's table has a
:class:`TpRole`; the layouts that split a model over ``tp`` (the FSDP2 engine's DTensor
plan, the SGLang / vLLM weights) and the FSDP2 runtime's parallel styles read it through
:func:`~areal_fn.model.families.roles.tp_record` instead of matching tensor names. Each reader maps a role to its own
placement: for example the FSDP2 engine replicates routed experts over ``tp`` while the
inference engines split them like a dense MLP, and a stacked expert tensor
(``[E, in, out]``, used as ``h @ W``) splits the last dim where a ``Linear`` weight
(``[out, in]``) splits the first.
"""

import enum


class TpRole(enum.Enum):
    """A canonical tensor's role under tensor parallelism."""

    #: Whole on every ``tp`` rank (norms, routers, biases after a row split, ...).
    REPLICATE = "replicate"
    #: Output features split over ``tp`` (query heads, gate/up columns, MLA up projections).
    COLUMN = "column"
    #: Key/value projections: output features split by KV head; inference engines with
    #: more ``tp`` ranks than KV heads replicate each head over ``tp // kv_heads`` ranks.
    KV = "kv"
    #: Input features split over ``tp`` (o_proj, down_proj); the output is summed.
    ROW = "row"
    #: One value per attention head, split with the heads (gpt-oss attention sinks).
    HEAD = "head"
    #: A norm applied per head after a column split (q/k norms of ``head_dim``): whole on
    #: every rank, each rank normalising its own heads, so its gradient is partial per rank.
    HEAD_NORM = "head_norm"
    #: Multi-latent attention's replicated ``kv_a_proj_with_mqa``: its last columns (the rope
    #: key shared by every head) get part of their gradient on each ``tp`` rank.
    SHARED_ROPE_KEY = "shared_rope_key"
    #: A gated delta net's per-value-head parameters (``A_log``, ``dt_bias``), split with
    #: the key-head groups: each ``tp`` rank holds ``linear_num_key_heads / tp`` key heads
    #: and their value heads, as Megatron-Core's ``GatedDeltaNet`` and vLLM split them. The
    #: module holding them (the linear-attention mixer) runs on its rank's head counts.
    DELTA_HEAD = "delta_head"
    #: A gated delta net's ``[q; k; v]`` channels (``conv1d``, Qwen3.5's ``in_proj_qkv``):
    #: all key heads' queries, then their keys, then all value heads' values, so a rank's
    #: key-head groups hold three row ranges, not one (:mod:`areal_fn.model.linear_tp`).
    DELTA_QKV = "delta_qkv"

    def __repr__(self) -> str:
        return f"TpRole.{self.name}"
