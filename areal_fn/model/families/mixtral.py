"""Mixtral (Mixtral-8x7B, 8x22B): Mistral attention, every layer a sparse MoE block.

Checkpoints (and ``save_pretrained`` in transformers 5) store each layer's MoE block
under ``block_sparse_moe``: a router ``gate.weight`` ``[num_local_experts, hidden]`` and
per expert ``e`` the SwiGLU weights ``experts.{e}.w1`` (gate), ``w3`` (up), ``w2``
(down), all ``intermediate_size`` wide. In memory transformers 5 renames the router
``mlp.gate.weight`` and fuses the experts into ``mlp.experts.gate_up_proj`` ``[E, 2*I,
H]`` (expert ``e`` = ``[w1_e; w3_e]``) and ``mlp.experts.down_proj`` ``[E, H, I]``. The
router takes the top-k logits and renormalises their softmax (Megatron:
``moe_router_pre_softmax=False``). ``router_jitter_noise`` must be 0 (the engines add
no noise); ``sliding_window`` as for Mistral (its default here is null).
"""

from areal_fn.model.families import CORE_KEYS, SOFTMAX_ROUTING, Family, FusedExperts
from areal_fn.model.families.mapping import (
    GQA_ATTENTION,
    GQA_ATTENTION_HF,
    LAYER_NORMS_HF,
    Dim,
    Fusion,
    HfTensor,
    LayerKind,
    MegatronTensor,
)
from areal_fn.model.families.tp_role import TpRole
from areal_fn.sharding.placement import Replicate, Shard, StridedShard

_MOE = LayerKind.MOE

#: The sparse MoE block's canonical tensors: the router, then per expert w1, w3, w2
#: (the order of transformers' fused in-memory tensors).
SPARSE_MOE_HF: tuple[HfTensor, ...] = (
    HfTensor(name="block_sparse_moe.gate.weight", shape=(Dim.EXPERTS, Dim.HIDDEN), layers=_MOE),
    *(
        HfTensor(
            name=f"block_sparse_moe.experts.{{e}}.{w}.weight",
            shape=shape,
            layers=_MOE,
            expert=True,
            tp=tp,
        )
        for w, shape, tp in (
            ("w1", (Dim.MOE_INTER, Dim.HIDDEN), TpRole.COLUMN),
            ("w3", (Dim.MOE_INTER, Dim.HIDDEN), TpRole.COLUMN),
            ("w2", (Dim.HIDDEN, Dim.MOE_INTER), TpRole.ROW),
        )
    ),
)

#: The same block in Megatron-Core: ``linear_fc1 = [w1; w3]``, ``linear_fc2 = w2``.
SPARSE_MOE: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="pre_mlp_layernorm.weight",
        hf="post_attention_layernorm.weight",
        tp=Replicate(),
        layers=_MOE,
    ),
    MegatronTensor(
        local="mlp.router.weight", hf="block_sparse_moe.gate.weight", tp=Replicate(), layers=_MOE
    ),
    MegatronTensor(
        local="mlp.experts.local_experts.{local}.linear_fc1.weight",
        grouped="mlp.experts.linear_fc1.weight{local}",
        hf=("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
        fusion=Fusion.GATE_UP,
        tp=StridedShard(dim=0, split_factor=2),
        expert=True,
        layers=_MOE,
    ),
    MegatronTensor(
        local="mlp.experts.local_experts.{local}.linear_fc2.weight",
        grouped="mlp.experts.linear_fc2.weight{local}",
        hf="block_sparse_moe.experts.{e}.w2.weight",
        tp=Shard(dim=1),
        expert=True,
        layers=_MOE,
    ),
)

#: transformers 5's in-memory fusion of the sparse MoE block's experts (expert ``e`` of
#: ``gate_up_proj`` = ``[w1_e; w3_e]``, of ``down_proj`` = ``w2_e``).
SPARSE_MOE_FUSED: tuple[FusedExperts, ...] = (
    FusedExperts(
        name="mlp.experts.gate_up_proj",
        parts=(
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
        ),
        concat_dim=0,
    ),
    FusedExperts(
        name="mlp.experts.down_proj",
        parts=("block_sparse_moe.experts.{e}.w2.weight",),
        concat_dim=0,
    ),
)

FAMILY = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SPARSE_MOE_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SPARSE_MOE),
    required=CORE_KEYS,
    defaults=(
        ("num_key_value_heads", 8),
        ("head_dim", None),  # None -> hidden_size // num_attention_heads
        ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 1e6),
        ("max_position_embeddings", 131072),
        ("sliding_window", None),
        ("num_experts", 8),
        ("num_experts_per_tok", 2),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
    ),
    bias_flags=(),
    fixed=(
        ("qkv_bias", False),
        ("o_bias", False),
        ("mlp_bias", False),
        ("qk_norm", False),
        ("norm_topk_prob", True),
        *SOFTMAX_ROUTING,
    ),
    moe=True,
    sliding_window="when_set",
    key_sources=(("moe_intermediate_size", "intermediate_size"),),
    must_be=(("router_jitter_noise", 0.0),),
    foreign_keys=(
        ("num_experts", "num_local_experts"),
        ("moe_intermediate_size", "intermediate_size (the experts' width)"),
        ("decoder_sparse_step", "nothing: every Mixtral layer is sparse"),
        ("mlp_only_layers", "nothing: every Mixtral layer is sparse"),
        ("norm_topk_prob", "nothing: Mixtral always renormalises the top-k"),
    ),
    memory_names=(("block_sparse_moe.gate.weight", "mlp.gate.weight"),),
    fused_experts=SPARSE_MOE_FUSED,
)
