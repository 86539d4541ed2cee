"""gpt-oss (``gpt_oss``: gpt-oss-20b, gpt-oss-120b): GQA with attention sinks and
q/k/v/o biases, sliding-window layers, every layer a softmax-routed MoE block with a
biased router and biased experts stored fused.

A layer holds ``self_attn.sinks`` ``[heads]`` (one learnt logit per head, added to the
softmax and dropped after it), ``self_attn.{q,k,v,o}_proj`` with biases
(``attention_bias``, default true), the router ``mlp.router.{weight,bias}``
``[E, H]``/``[E]`` and the experts as four stacked tensors, in the checkpoint as in
memory: ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (used as ``h @ W``; column ``2j``
is gate unit ``j``, ``2j+1`` up unit ``j``), ``gate_up_proj_bias`` ``[E, 2I]``,
``down_proj`` ``[E, I, H]`` and ``down_proj_bias`` ``[E, H]``, ``I`` being
``intermediate_size``. The experts apply a clamped SwiGLU: gate clamped above and up on
both sides at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``.
Layers that ``layer_types`` marks ``sliding_attention`` (default: the even ones) attend
to the last ``sliding_window`` tokens. The router's top-k logits are softmaxed.

Megatron-Core (local spec, ``add_bias_linear``): ``sinks`` is the core attention's
``softmax_offset`` (sharded by head), the router keeps its names, and expert ``e``'s
``linear_fc1`` is ``[W[e][:, ::2].T; W[e][:, 1::2].T]`` (its bias likewise),
``linear_fc2`` is ``down_proj[e].T``: pieces with a stride and a transpose
(:data:`~areal_fn.model.families.mapping.Fusion.EXPERT_GLU`, ``EXPERT``). Megatron-Core
refuses expert tensor parallelism with expert biases, so the layouts refuse ``etp > 1``.

Published checkpoints store the experts' weights as MXFP4 (``*_blocks``, ``*_scales``
and a ``quantization_config``): the spec describes the model as transformers builds it
(bf16), and the HF readers dequantise each ``X_blocks`` / ``X_scales`` pair to ``X``
as they read it (:mod:`areal_fn.runtime.hf.mxfp4_io`); writing MXFP4 is not offered.
"""

from areal_fn.model.families import CORE_KEYS, SOFTMAX_ROUTING, Family
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
from areal_fn.model.families.serving import Serving
from areal_fn.model.families.tp_role import TpRole
from areal_fn.sharding.placement import Replicate, Shard

_MOE = LayerKind.MOE


def _stacked(name: str, tp: TpRole, *shape: Dim) -> HfTensor:
    return HfTensor(
        name=f"mlp.experts.{name}", shape=(Dim.EXPERTS, *shape), layers=_MOE, stacked=True, tp=tp
    )


#: The attention sinks, first in the state dict (a parameter of the attention module
#: itself), then grouped-query attention with its biases.
SINK_ATTENTION_HF: tuple[HfTensor, ...] = (
    HfTensor(name="self_attn.sinks", shape=(Dim.HEADS,), tp=TpRole.HEAD),
    *GQA_ATTENTION_HF,
)

#: The MoE block: the biased router, then the four stacked expert tensors.
FUSED_EXPERTS_HF: tuple[HfTensor, ...] = (
    HfTensor(name="mlp.router.weight", shape=(Dim.EXPERTS, Dim.HIDDEN), layers=_MOE),
    HfTensor(name="mlp.router.bias", shape=(Dim.EXPERTS,), layers=_MOE),
    _stacked("gate_up_proj", TpRole.COLUMN, Dim.HIDDEN, Dim.GLU_INTER),
    _stacked("gate_up_proj_bias", TpRole.COLUMN, Dim.GLU_INTER),
    _stacked("down_proj", TpRole.ROW, Dim.MOE_INTER, Dim.HIDDEN),
    _stacked("down_proj_bias", TpRole.REPLICATE, Dim.HIDDEN),
)


def _expert(local: str, hf: str, fusion: Fusion, tp: Shard | Replicate) -> MegatronTensor:
    return MegatronTensor(
        local=f"mlp.experts.local_experts.{{local}}.{local}",
        grouped=f"mlp.experts.{local}{{local}}",
        hf=f"mlp.experts.{hf}",
        fusion=fusion,
        tp=tp,
        expert=True,
        layers=_MOE,
    )


#: Megatron-Core: sinks as the core attention's softmax offset, the biased router, and
#: per expert ``linear_fc1`` / ``linear_fc2`` with biases taken out of the stacked tensors.
SINKS_AND_EXPERTS: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="self_attention.core_attention.softmax_offset",
        hf="self_attn.sinks",
        tp=Shard(dim=0),
    ),
    MegatronTensor(
        local="pre_mlp_layernorm.weight",
        hf="post_attention_layernorm.weight",
        tp=Replicate(),
        layers=_MOE,
    ),
    MegatronTensor(local="mlp.router.weight", hf="mlp.router.weight", tp=Replicate(), layers=_MOE),
    MegatronTensor(local="mlp.router.bias", hf="mlp.router.bias", tp=Replicate(), layers=_MOE),
    _expert("linear_fc1.weight", "gate_up_proj", Fusion.EXPERT_GLU, Replicate()),
    _expert("linear_fc1.bias", "gate_up_proj_bias", Fusion.EXPERT_GLU, Replicate()),
    _expert("linear_fc2.weight", "down_proj", Fusion.EXPERT, Replicate()),
    _expert("linear_fc2.bias", "down_proj_bias", Fusion.EXPERT, Replicate()),
)

FAMILY = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    canonical=(*SINK_ATTENTION_HF, *FUSED_EXPERTS_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SINKS_AND_EXPERTS),
    required=CORE_KEYS,
    defaults=(
        ("num_key_value_heads", 8),
        ("head_dim", 64),  # the config class's default, not hidden_size // heads
        ("tie_word_embeddings", False),
        ("attention_bias", True),
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 150000.0),
        ("max_position_embeddings", 131072),
        # the config class's rope when the config gives neither rope_scaling nor
        # rope_parameters (plain rope must then be asked for: rope_type "default")
        (
            "rope_scaling",
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        ),
        ("sliding_window", 128),
        ("swiglu_alpha", 1.702),
        ("swiglu_limit", 7.0),
        ("num_experts", 128),
        ("num_experts_per_tok", 4),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
    ),
    bias_flags=(("attention_bias", ("qkv_bias", "o_bias")),),
    fixed=(
        ("mlp_bias", True),
        ("qk_norm", False),
        ("norm_topk_prob", True),
        *SOFTMAX_ROUTING,
    ),
    moe=True,
    sliding_window="layer_types",
    clamped_swiglu=True,
    key_sources=(("moe_intermediate_size", "intermediate_size"),),
    foreign_keys=(
        ("moe_intermediate_size", "intermediate_size (the experts' width)"),
        ("decoder_sparse_step", "nothing: every gpt-oss layer is sparse"),
        ("mlp_only_layers", "nothing: every gpt-oss layer is sparse"),
        ("norm_topk_prob", "nothing: gpt-oss always softmaxes the top-k logits"),
    ),
    serving=Serving(megatron_yarn=True),
)
