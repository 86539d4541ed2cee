"""Qwen3-Next (``qwen3_next``: Qwen3-Next-80B-A3B): three gated-delta-net linear-attention
layers to one gated full-attention layer, every layer with routed experts and a gated
shared expert; (1 + w) RMSNorms; rope on a quarter of each head.

A layer is linear attention or full attention as ``layer_types`` says (default: every
``full_attention_interval``-th layer, 4, is full; :mod:`areal_fn.model.linear_attention`).
A full-attention layer is Qwen3's (per-head q/k norms) with ``q_proj`` twice as wide:
per head ``[q_h; gate_h]``, the attention output multiplied by ``sigmoid(gate)``. A
linear-attention layer holds ``linear_attn.{dt_bias, A_log}``, ``conv1d.weight``
``[2*key_dim + value_dim, 1, conv_kernel]``, ``in_proj_qkvz`` (per key-head group ``g``:
``[q_g; k_g; v_g; z_g]``), ``in_proj_ba`` (per group ``[b_g; a_g]``), ``norm`` (a gated
RMSNorm of ``value_head_dim``) and ``out_proj``. The MoE block: router ``mlp.gate``,
experts ``mlp.experts.{e}.{gate,up,down}_proj`` (softmax top-k, ``norm_topk_prob``), a
shared SwiGLU expert ``mlp.shared_expert`` of ``shared_expert_intermediate_size`` scaled
by ``sigmoid(mlp.shared_expert_gate(x))``. Layers in ``mlp_only_layers`` (or off the
``decoder_sparse_step``) have a dense MLP of ``intermediate_size``. The published
checkpoint's ``mtp.*`` tensors are not part of the model transformers builds.

Where it runs: specs, FSDP2 layouts (data and tensor parallel), inference layouts,
Megatron layouts (Megatron-Core's ``GatedDeltaNet`` and gated attention:
:data:`GATED_ATTENTION`, :func:`gated_delta_net`; built by
:mod:`areal_fn.runtime.megatron.gated_delta`), weight sync, checkpoints and HF export.
Under ``tp`` in the FSDP2 engine a linear-attention layer splits by key-head group
(:mod:`areal_fn.model.linear_tp`; ``tp`` must divide ``linear_num_key_heads``), the
full-attention layers by heads as Qwen3's. Refused, with the reason: splitting a
sequence over ranks (Ulysses, CP) and packed rows in the Megatron engine. Packed rows
train in the FSDP2 engine: it runs each linear-attention layer on every packed
sequence alone.
"""

import attrs

from areal_fn.model.families import SOFTMAX_ROUTING, STACKED_SWIGLU_EXPERTS, Family
from areal_fn.model.families.mapping import (
    GQA_ATTENTION,
    GQA_ATTENTION_HF,
    LAYER_NORMS_HF,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_HF,
    SWIGLU_MLP,
    SWIGLU_MLP_HF,
    Dim,
    Fusion,
    HfTensor,
    LayerKind,
    MegatronTensor,
)
from areal_fn.model.families.mixer import Mixer
from areal_fn.model.families.serving import Serving
from areal_fn.model.families.tp_role import TpRole
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard

_FULL, _LINEAR = Mixer.ATTENTION, Mixer.LINEAR
_HEAD, _COL = TpRole.DELTA_HEAD, TpRole.COLUMN

#: Gated full attention: Qwen3's attention whose q_proj also gives the output gate.
GATED_ATTENTION_HF: tuple[HfTensor, ...] = tuple(
    attrs.evolve(r, shape=(Dim.GATED_Q_OUT, Dim.HIDDEN), mixer=_FULL)
    if r.name == "self_attn.q_proj.weight"
    else attrs.evolve(r, mixer=_FULL)
    for r in GQA_ATTENTION_HF
    if r.when != "qkv_bias" and r.when != "o_bias"
)


def linear_params_hf() -> tuple[HfTensor, ...]:
    """The per-value-head parameters and the conv, first in a linear-attention layer."""
    return (
        *(
            HfTensor(name=f"linear_attn.{n}", shape=(Dim.LIN_V_HEADS,), mixer=_LINEAR, tp=_HEAD)
            for n in ("dt_bias", "A_log")
        ),
        HfTensor(
            name="linear_attn.conv1d.weight",
            shape=(Dim.LIN_QKV, Dim.ONE, Dim.LIN_CONV),
            mixer=_LINEAR,
            tp=TpRole.DELTA_QKV,
        ),
    )


#: The gated RMSNorm and the output projection of a linear-attention layer.
LINEAR_TAIL_HF: tuple[HfTensor, ...] = (
    HfTensor(
        name="linear_attn.norm.weight",
        shape=(Dim.LIN_V_HEAD_DIM,),
        mixer=_LINEAR,
        tp=TpRole.HEAD_NORM,
    ),
    HfTensor(
        name="linear_attn.out_proj.weight",
        shape=(Dim.HIDDEN, Dim.LIN_V),
        mixer=_LINEAR,
        tp=TpRole.ROW,
    ),
)

#: Qwen3-Next's gated delta net: fused per-group projections ``in_proj_qkvz``, ``in_proj_ba``.
FUSED_GATED_DELTA_NET_HF: tuple[HfTensor, ...] = (
    *linear_params_hf(),
    *(  # per key-head group: a contiguous split of the rows is a split by groups
        HfTensor(name=f"linear_attn.{n}.weight", shape=(d, Dim.HIDDEN), mixer=_LINEAR, tp=_COL)
        for n, d in (("in_proj_qkvz", Dim.LIN_QKVZ), ("in_proj_ba", Dim.LIN_BA))
    ),
    *LINEAR_TAIL_HF,
)

#: The router first, routed experts, then the gated shared expert (Qwen2-MoE's block).
GATED_SHARED_MOE_HF: tuple[HfTensor, ...] = (
    *(r for r in ROUTED_EXPERTS_HF if r.name == "mlp.gate.weight"),
    *(r for r in ROUTED_EXPERTS_HF if r.expert),
    *(
        HfTensor(name=f"mlp.shared_expert.{n}.weight", shape=s, layers=LayerKind.MOE, tp=tp)
        for n, s, tp in (
            ("gate_proj", (Dim.SHARED_EXPERT, Dim.HIDDEN), TpRole.COLUMN),
            ("up_proj", (Dim.SHARED_EXPERT, Dim.HIDDEN), TpRole.COLUMN),
            ("down_proj", (Dim.HIDDEN, Dim.SHARED_EXPERT), TpRole.ROW),
        )
    ),
    HfTensor(
        name="mlp.shared_expert_gate.weight", shape=(Dim.ONE, Dim.HIDDEN), layers=LayerKind.MOE
    ),
)

#: Megatron-Core's gated attention (``attention_output_gate``): GQA with the gates in
#: ``linear_qkv`` (``Fusion.GATED_QKV``), full-attention layers only.
GATED_ATTENTION: tuple[MegatronTensor, ...] = tuple(
    MegatronTensor(
        local=r.local,
        te=r.te,
        hf=r.hf,
        tp=r.tp,
        fusion=Fusion.GATED_QKV if r.fusion is Fusion.QKV else r.fusion,
        when=r.when,
        mixer=_FULL,
    )
    for r in GQA_ATTENTION
    if r.when not in ("qkv_bias", "o_bias")
)


def gated_delta_net(in_proj: tuple[str, ...], fusion: Fusion) -> tuple[MegatronTensor, ...]:
    """Megatron-Core's ``GatedDeltaNet`` (linear-attention layers) with the input norm before
    it: ``in_proj`` from the canonical ``in_proj`` sources by ``fusion`` and ``conv1d``, both
    laid per TP rank (:mod:`areal_fn.layouts.gated_delta`); the per-value-head ``dt_bias``,
    ``A_log`` and ``out_proj`` columns split over TP; ``out_norm`` replicated."""
    la = "linear_attn."

    def rec(
        local: str,
        hf: str | tuple[str, ...],
        tp: Placement,
        fusion: Fusion = Fusion.WHOLE,
        te: str | None = None,
    ) -> MegatronTensor:
        return MegatronTensor(local=local, hf=hf, tp=tp, fusion=fusion, te=te, mixer=_LINEAR)

    return (
        rec(
            "input_layernorm.weight",
            "input_layernorm.weight",
            Replicate(),
            te="self_attention.in_proj.layer_norm_weight",
        ),
        rec("self_attention.dt_bias", la + "dt_bias", Shard(dim=0)),
        rec("self_attention.A_log", la + "A_log", Shard(dim=0)),
        rec("self_attention.in_proj.weight", tuple(la + n for n in in_proj), Shard(0), fusion),
        rec("self_attention.conv1d.weight", la + "conv1d.weight", Shard(0), Fusion.GDN_CONV),
        rec("self_attention.out_norm.weight", la + "norm.weight", Replicate()),
        rec("self_attention.out_proj.weight", la + "out_proj.weight", Shard(dim=1)),
    )


#: The gated shared expert: ``linear_fc1 = [gate; up]`` strided over TP, ``linear_fc2`` by
#: columns, the scalar gate ``gate_weight`` replicated (``moe_shared_expert_gate``).
GATED_SHARED_EXPERT: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="mlp.shared_experts.gate_weight",
        hf="mlp.shared_expert_gate.weight",
        tp=Replicate(),
        layers=LayerKind.MOE,
    ),
    MegatronTensor(
        local="mlp.shared_experts.linear_fc1.weight",
        hf=("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        fusion=Fusion.GATE_UP,
        tp=StridedShard(dim=0, split_factor=2),
        layers=LayerKind.MOE,
    ),
    MegatronTensor(
        local="mlp.shared_experts.linear_fc2.weight",
        hf="mlp.shared_expert.down_proj.weight",
        tp=Shard(dim=1),
        layers=LayerKind.MOE,
    ),
)

#: The Megatron-Core parameters after the attention: dense MLP or experts, the shared expert.
LINEAR_MOE_MLP: tuple[MegatronTensor, ...] = (*SWIGLU_MLP, *ROUTED_EXPERTS, *GATED_SHARED_EXPERT)

#: How the Megatron builder builds these families (:mod:`areal_fn.runtime.megatron.gated_delta`).
MEGATRON_GATED_DELTA = Serving(megatron_gated_delta=True)

#: Why Ulysses and context parallelism are refused (shared by Qwen3.5).
SEQUENCE_REFUSAL = (
    "{mt}'s linear-attention layers carry a recurrent state that must see the whole "
    "sequence in order, and Ulysses and context parallelism would run it over one rank's "
    "part of each sequence; use c=1"
)

#: The defaults the Qwen3-Next and Qwen3.5 config classes share.
LINEAR_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("num_key_value_heads", 2),
    ("head_dim", 256),
    ("tie_word_embeddings", False),
    ("attention_bias", False),
    ("rms_norm_eps", 1e-6),
    ("rope_theta", 10000.0),
    ("max_position_embeddings", 32768),
    ("partial_rotary_factor", 0.25),
    ("full_attention_interval", 4),
    ("linear_conv_kernel_dim", 4),
    ("linear_key_head_dim", 128),
    ("linear_value_head_dim", 128),
    ("linear_num_key_heads", 16),
    ("linear_num_value_heads", 32),
)


FAMILY = Family(
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    canonical=(
        *GATED_ATTENTION_HF,
        *FUSED_GATED_DELTA_NET_HF,
        *SWIGLU_MLP_HF,
        *GATED_SHARED_MOE_HF,
        *LAYER_NORMS_HF,
    ),
    megatron=(
        *GATED_ATTENTION,
        *gated_delta_net(("in_proj_qkvz.weight", "in_proj_ba.weight"), Fusion.GDN_IN_PROJ),
        *LINEAR_MOE_MLP,
    ),
    required=("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    defaults=(
        *LINEAR_DEFAULTS,
        ("intermediate_size", 5632),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
        ("norm_topk_prob", True),
        ("num_experts", 512),
        ("num_experts_per_tok", 10),
        ("moe_intermediate_size", 512),
        ("shared_expert_intermediate_size", 512),
    ),
    bias_flags=(),
    fixed=(
        ("qkv_bias", False),
        ("o_bias", False),
        ("mlp_bias", False),
        ("qk_norm", True),
        *SOFTMAX_ROUTING,
    ),
    moe=True,
    fused_experts=STACKED_SWIGLU_EXPERTS,
    partial_rotary=True,
    linear_attention=True,
    must_be=(("attention_bias", False),),
    foreign_keys=(("num_local_experts", "num_experts"),),
    serving=MEGATRON_GATED_DELTA,
    sequence_refusal=SEQUENCE_REFUSAL.format(mt="qwen3_next"),
)
