"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``glm4_moe``): GQA with partial rotary, optional
q/k norms and q/k/v biases; ``first_k_dense_replace`` dense layers, then MoE layers with
a sigmoid router, a score-correction bias, group-limited top-k and shared experts.

An MoE layer holds the router ``mlp.gate.weight`` ``[E, H]`` and its buffer
``mlp.gate.e_score_correction_bias`` ``[E]`` (both float32 whatever the model's dtype),
routed experts ``mlp.experts.{e}.{gate,up,down}_proj`` of ``moe_intermediate_size``,
and ``mlp.shared_experts.{gate,up,down}_proj`` of ``n_shared_experts *
moe_intermediate_size``. transformers 5 fuses the routed experts in memory as Qwen3-MoE
does. Multi-token-prediction layers (``num_nextn_predict_layers``) are not part of the
model transformers builds or ``save_pretrained`` writes; they are canonical tensors when
the spec is read with ``mtp=True`` (:mod:`areal_fn.model.mtp`), and otherwise a
checkpoint that holds them (``model.layers.{num_hidden_layers}.*``) is refused by the
strict readers, which list them as unexpected, not dropped.
"""

import attrs

from areal_fn.model.families import STACKED_SWIGLU_EXPERTS, Family
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
from areal_fn.model.families.serving import MtpBlock
from areal_fn.model.families.tp_role import TpRole
from areal_fn.sharding.placement import Replicate, Shard, StridedShard

_MOE = LayerKind.MOE

#: The router (float32), its score-correction buffer, then the shared experts.
ROUTER_AND_SHARED_HF: tuple[HfTensor, ...] = (
    HfTensor(
        name="mlp.gate.e_score_correction_bias",
        shape=(Dim.EXPERTS,),
        when="router_bias",
        layers=_MOE,
        dtype="float32",
        buffer=True,
    ),
    *(
        HfTensor(
            name=f"mlp.shared_experts.{n}.weight",
            shape=shape,
            when="num_shared_experts",
            layers=_MOE,
            tp=tp,
        )
        for n, shape, tp in (
            ("gate_proj", (Dim.SHARED_INTER, Dim.HIDDEN), TpRole.COLUMN),
            ("up_proj", (Dim.SHARED_INTER, Dim.HIDDEN), TpRole.COLUMN),
            ("down_proj", (Dim.HIDDEN, Dim.SHARED_INTER), TpRole.ROW),
        )
    ),
)


def float32_router(table: tuple[HfTensor, ...]) -> tuple[HfTensor, ...]:
    return tuple(
        attrs.evolve(r, dtype="float32") if r.name == "mlp.gate.weight" else r for r in table
    )


#: Megatron-Core: ``mlp.router.expert_bias`` (a buffer), shared experts on the dense TP
#: group (``linear_fc1 = [gate; up]`` strided over TP, ``linear_fc2`` by columns).
ROUTER_AND_SHARED: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="mlp.router.expert_bias",
        hf="mlp.gate.e_score_correction_bias",
        tp=Replicate(),
        when="router_bias",
        layers=_MOE,
    ),
    MegatronTensor(
        local="mlp.shared_experts.linear_fc1.weight",
        hf=("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        fusion=Fusion.GATE_UP,
        tp=StridedShard(dim=0, split_factor=2),
        when="num_shared_experts",
        layers=_MOE,
    ),
    MegatronTensor(
        local="mlp.shared_experts.linear_fc2.weight",
        hf="mlp.shared_experts.down_proj.weight",
        tp=Shard(dim=1),
        when="num_shared_experts",
        layers=_MOE,
    ),
)

#: The config keys of the DeepSeek-style MoE block (GLM-4.5, DeepSeek-V3): keys other
#: families use that these config classes lack, and the routing fields they give.
DEEPSEEK_MOE_FOREIGN_KEYS: tuple[tuple[str, str], ...] = (
    ("num_experts", "n_routed_experts"),
    ("num_local_experts", "n_routed_experts"),
    ("decoder_sparse_step", "first_k_dense_replace"),
    ("mlp_only_layers", "first_k_dense_replace"),
)
DEEPSEEK_MOE_KEYS: tuple[tuple[str, str], ...] = (
    ("num_shared_experts", "n_shared_experts"),
    ("router_groups", "n_group"),
    ("router_group_topk", "topk_group"),
    ("routed_scaling_factor", "routed_scaling_factor"),
)

#: A DeepSeek-style decoder layer after its attention: dense SwiGLU or routed experts
#: behind a float32 sigmoid router with its score correction, shared experts, the norms.
DEEPSEEK_MOE_LAYER_HF: tuple[HfTensor, ...] = (
    *SWIGLU_MLP_HF,
    *float32_router(ROUTED_EXPERTS_HF),
    *ROUTER_AND_SHARED_HF,
    *LAYER_NORMS_HF,
)
DEEPSEEK_MOE_LAYER: tuple[MegatronTensor, ...] = (
    *SWIGLU_MLP,
    *ROUTED_EXPERTS,
    *ROUTER_AND_SHARED,
)

FAMILY = Family(
    model_type="glm4_moe",
    architecture="Glm4MoeForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *DEEPSEEK_MOE_LAYER_HF),
    megatron=(*GQA_ATTENTION, *DEEPSEEK_MOE_LAYER),
    required=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "moe_intermediate_size",
    ),
    defaults=(
        ("head_dim", None),  # None -> hidden_size // num_attention_heads
        ("tie_word_embeddings", False),
        ("attention_bias", False),
        ("use_qk_norm", False),
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 10000.0),
        ("partial_rotary_factor", 0.5),
        ("max_position_embeddings", 131072),
        ("num_experts", 128),
        ("num_experts_per_tok", 8),
        ("n_shared_experts", 1),
        ("routed_scaling_factor", 1.0),
        ("n_group", 1),
        ("topk_group", 1),
        ("first_k_dense_replace", 1),
        ("num_nextn_predict_layers", 1),
        ("norm_topk_prob", True),
    ),
    bias_flags=(("attention_bias", ("qkv_bias",)), ("use_qk_norm", ("qk_norm",))),
    fixed=(
        ("o_bias", False),
        ("mlp_bias", False),
        ("router_score", "sigmoid"),
        ("router_bias", True),
    ),
    moe=True,
    partial_rotary=True,
    first_k_dense="first_k_dense_replace",
    mtp=MtpBlock(),
    key_sources=(("num_experts", "n_routed_experts"),),
    foreign_keys=DEEPSEEK_MOE_FOREIGN_KEYS,
    moe_keys=DEEPSEEK_MOE_KEYS,
    fused_experts=STACKED_SWIGLU_EXPERTS,
)
