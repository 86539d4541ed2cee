"""Hugging Face-style architecture fields -> a CPU-safe Megatron-Core ``TransformerConfig``.

The architecture comes in as a plain mapping (see :data:`ARCH_FIELDS`), the parallel
sizes as a :class:`~areal_fn.runtime.megatron.parallel.MegatronSizes`.
:func:`transformer_config` gathers its fields in named steps: the architecture, the MoE
fields (MoE models only), the parallel sizes, and the CPU settings (no fused kernels,
weights created on CPU). Re-exported by :mod:`areal_fn.runtime.megatron.build`.
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from areal_fn.errors import LayoutError, SpecError
from areal_fn.runtime.megatron.parallel import MegatronSizes
from areal_fn.typecheck import beartype

__all__ = [
    "ARCH_FIELDS",
    "arch_field",
    "arch_of",
    "gated_delta_fields",
    "mla_fields",
    "transformer_config",
]

#: The architecture fields read from the ``arch`` mapping (``None`` = optional).
ARCH_FIELDS: Mapping[str, str] = {
    "hidden_size": "int",
    "num_layers": "int (HF num_hidden_layers)",
    "num_attention_heads": "int",
    "num_key_value_heads": "int",
    "head_dim": "int or None (default hidden_size // num_attention_heads)",
    "intermediate_size": "int (dense MLP width)",
    "vocab_size": "int",
    "max_position_embeddings": "int or None (default 4096)",
    "tie_word_embeddings": "bool",
    "qkv_bias": "bool (qwen2)",
    "qk_norm": "bool (qwen3: RMSNorm over head_dim on q and k)",
    "rms_norm_eps": "float",
    "rope_theta": "float",
    "rope_scaling": "mapping, (key, value) pairs or None (only rope_type 'llama3'; see rope_kwargs)",
    "num_experts": "int or None (MoE when set)",
    "moe_intermediate_size": "int or None (expert MLP width)",
    "num_experts_per_tok": "int or None (router top-k)",
    "norm_topk_prob": "bool or None (renormalise top-k probabilities; default True)",
    "moe_layer_pattern": "sequence of 0/1 per layer or None (all layers MoE)",
    "num_shared_experts": "int or None (shared experts of moe_intermediate_size each)",
    "router_score": "'softmax' (default) or 'sigmoid'",
    "router_bias": "bool or None (a fixed per-expert score correction for the choice)",
    "router_groups": "int or None (group-limited routing: groups of experts)",
    "router_group_topk": "int or None (groups kept per token)",
    "routed_scaling_factor": "float or None (routed weights scaled by it)",
    "rotary_fraction": "float or None (GPTModel rotary_percent; default 1.0)",
    "kv_lora_rank": "int or None (multi-latent attention when set; see mla_fields)",
    "q_lora_rank": "int or None (multi-latent attention: 0/None = q_proj without LoRA)",
    "qk_rope_head_dim": "int or None (multi-latent attention: rotary dims per head)",
    "v_head_dim": "int or None (multi-latent attention: value dims per head)",
    "o_bias": "bool or None (attention output bias; with mlp_bias: add_bias_linear)",
    "mlp_bias": "bool or None (MLP / expert biases; needs o_bias and qkv_bias too)",
    "attention_sinks": "bool or None (a learnt softmax logit per head: softmax_type learnable)",
    "sliding_window": "int or None (window of the sliding layers, in tokens)",
    "sliding_layers": "sequence of bools per layer or None (True: the layer slides)",
    "swiglu_alpha": "float or None (gpt-oss clamped SwiGLU: 1.702, Megatron's quick_gelu)",
    "swiglu_limit": "float or None (gpt-oss clamped SwiGLU: the clamp of gate and up)",
    "mtp_layers": "int or None (multi-token-prediction layers: mtp_num_layers, last stage)",
    "gated_delta": "bool or None (gated-delta-net family: Family.serving.megatron_gated_delta)",
    "linear_attention": "LinearAttention, its attrs.asdict mapping, or None (which layers)",
    "shared_expert_size": "int or None (the gated shared expert's width)",
}


def arch_of(spec: Any) -> dict[str, Any]:
    """The architecture mapping of a :class:`~areal_fn.model.spec.ModelSpec`: its fields,
    with the MoE layers as ``moe_layer_pattern`` (one 0/1 per layer) for MoE models."""
    import attrs

    arch = attrs.asdict(spec)
    arch["moe_layer_pattern"] = [int(m) for m in spec.moe_layers] if spec.is_moe else None
    arch["attention_sinks"] = spec.has_sinks
    arch["gated_delta"] = spec.family.serving.megatron_gated_delta
    return arch


def arch_field(arch: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """``arch[name]``, or ``default`` when it is absent or ``None``."""
    value = arch.get(name, default)
    return default if value is None else value


@beartype
def transformer_config(
    arch: Mapping[str, Any],
    sizes: MegatronSizes,
    *,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    pipeline_model_parallel_layout: str | None = None,
    moe_grouped_gemm: bool = False,
    params_dtype: torch.dtype = torch.float32,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """A CPU-safe fp32 ``TransformerConfig`` for ``arch`` under ``sizes``.

    Fusions off (rope, masked softmax, bias-activation, bias-dropout, persistent
    layer norm, gradient-accumulation), no dropout, ``use_cpu_initialization``,
    RMSNorm, SwiGLU, no linear biases (qkv bias from ``arch["qkv_bias"]``), allgather
    MoE dispatcher, no load-balancing loss. Uneven pipeline stages: either
    ``num_layers_in_first/last_pipeline_stage`` or a ``pipeline_model_parallel_layout``
    string such as ``"Et|tt|tL"`` (E = embedding, t = layer, L = loss, ``|`` = next
    stage, virtual stages included). ``overrides`` are further ``TransformerConfig``
    fields, applied last (e.g. ``{"moe_token_dispatcher_type": "alltoall"}``).
    """
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    fields: dict[str, Any] = dict(
        **_architecture_fields(arch),
        **_parallel_fields(
            sizes,
            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
            pipeline_model_parallel_layout=pipeline_model_parallel_layout,
            pipeline_dtype=params_dtype,
        ),
        **_cpu_fields(params_dtype),
        **_moe_fields(arch, moe_grouped_gemm=moe_grouped_gemm),
    )
    fields.update(_gpt_oss_fields(arch))
    fields.update(gated_delta_fields(arch))
    if arch_field(arch, "kv_lora_rank", 0):
        fields.update(mla_fields(arch))
        fields.update(overrides or {})
        return MLATransformerConfig(**fields)
    fields.update(overrides or {})
    config = TransformerConfig(**fields)
    for name, value in yarn_attributes(arch).items():  # read by GPTModel's yarn rope
        setattr(config, name, value)
    return config


def _gpt_oss_fields(arch: Mapping[str, Any]) -> dict[str, Any]:
    """Biases on every linear, attention sinks, sliding windows, the clamped SwiGLU.

    ``add_bias_linear`` when ``o_bias`` and ``mlp_bias`` (it biases attention output and
    MLP together; MLP biases without an output bias are refused). Sinks: ``softmax_type
    = "learnable"`` (``core_attention.softmax_offset``). Sliding layers: ``window_size =
    (sliding_window - 1, 0)`` (transformers attends ``i - j < window``) on the layers
    ``window_attn_skip_freq`` marks 1. ``swiglu_limit``: Megatron's ``quick_gelu`` (whose
    sigmoid gain is 1.702: another ``swiglu_alpha`` is refused), ``glu_linear_offset=1``
    and the clamp.
    """
    out: dict[str, Any] = {}
    if arch.get("mlp_bias"):
        if not (arch.get("o_bias") and arch.get("qkv_bias")):
            raise LayoutError(
                "mlp_bias without q/k/v/o biases: Megatron-Core's add_bias_linear biases the "
                "attention and MLP linears together, so this model cannot be built there; use "
                "the fsdp backend (or a config with attention_bias true)"
            )
        out["add_bias_linear"] = True
    if arch.get("attention_sinks"):
        out["softmax_type"] = "learnable"
    sliding = [bool(x) for x in arch.get("sliding_layers") or ()]
    if any(sliding):
        out["window_size"] = (int(arch["sliding_window"]) - 1, 0)
        out["window_attn_skip_freq"] = [int(x) for x in sliding]
    limit = arch.get("swiglu_limit")
    if limit is not None:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        if arch.get("swiglu_alpha") != 1.702:
            raise LayoutError(
                f"swiglu_alpha={arch.get('swiglu_alpha')!r}: Megatron-Core's quick_gelu is "
                "x * sigmoid(1.702 x); use the fsdp backend for another gain"
            )
        out.update(
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=float(limit),
        )
    return out


def gated_delta_fields(arch: Mapping[str, Any]) -> dict[str, Any]:
    """A gated-delta-net family's fields (none for others): Megatron-Core's
    ``GatedDeltaNet`` on the layers ``linear_attention`` marks (``linear_attention_freq``,
    1 = linear), its head counts and sizes, the sigmoid gate of the full-attention output
    (``attention_output_gate``), ``(1 + w)`` norms (``layernorm_zero_centered_gamma``),
    and for MoE models the gated shared expert (``moe_shared_expert_gate``)."""
    if not arch.get("gated_delta"):
        return {}
    la = arch["linear_attention"]
    get = la.__getitem__ if isinstance(la, Mapping) else la.__getattribute__
    out: dict[str, Any] = {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(bool(x)) for x in get("layers")],
        "linear_conv_kernel_dim": get("conv_kernel"),
        "linear_key_head_dim": get("key_head_dim"),
        "linear_value_head_dim": get("value_head_dim"),
        "linear_num_key_heads": get("key_heads"),
        "linear_num_value_heads": get("value_heads"),
        "attention_output_gate": True,
        "layernorm_zero_centered_gamma": True,
    }
    if arch.get("num_experts"):
        out["moe_shared_expert_intermediate_size"] = arch["shared_expert_size"]
        out["moe_shared_expert_gate"] = True
    return out


def yarn_attributes(arch: Mapping[str, Any]) -> dict[str, Any]:
    """The ``yarn_*`` config attributes ``GPTModel(position_embedding_type="yarn")`` reads,
    for a yarn rope scaling (none otherwise, and none for multi-latent attention, whose
    config class has its own fields): transformers' ``truncate`` is Megatron's
    ``correction_range_round_to_int``; without ``mscale`` both apply ``0.1 ln(factor) + 1``."""
    raw = arch.get("rope_scaling")
    items: dict[str, Any] = dict(raw.items() if isinstance(raw, Mapping) else raw or ())
    if items.get("rope_type") != "yarn" or arch_field(arch, "kv_lora_rank", 0):
        return {}
    if items.get("attention_factor") is not None:
        raise LayoutError(
            f"yarn rope scaling {items} sets attention_factor, which Megatron-Core's yarn does "
            "not take; use the fsdp backend"
        )
    return {
        "yarn_rotary_scaling_factor": float(items["factor"]),
        "yarn_original_max_position_embeddings": int(items["original_max_position_embeddings"]),
        "yarn_beta_fast": float(items.get("beta_fast", 32)),
        "yarn_beta_slow": float(items.get("beta_slow", 1)),
        "yarn_mscale": float(items.get("mscale", 1.0)),
        "yarn_mscale_all_dim": float(items.get("mscale_all_dim", 0.0)),
        "yarn_correction_range_round_to_int": bool(items.get("truncate", True)),
    }


#: The epsilon of transformers' DeepSeek-V3 q/kv latent norms (fixed in its code).
MLA_LATENT_NORM_EPS = 1e-6


def mla_fields(arch: Mapping[str, Any]) -> dict[str, Any]:
    """``MLATransformerConfig``'s multi-latent attention fields for ``arch``: the ranks,
    head dims, latent norms (``qk_layernorm``), rotary embedding (``rope`` or ``yarn``).

    ``kv_channels`` is ``v_head_dim`` (the core attention's output width per head).
    ``LayoutError`` where Megatron would compute otherwise than transformers: an
    ``rms_norm_eps`` other than the latent norms' 1e-6 (Megatron applies one epsilon to
    every norm), a rope scaling other than yarn, a yarn ``mscale`` other than 1 without
    ``mscale_all_dim`` (transformers then ignores ``mscale``).
    """
    if arch["rms_norm_eps"] != MLA_LATENT_NORM_EPS:
        raise LayoutError(
            f"rms_norm_eps={arch['rms_norm_eps']}: transformers' multi-latent attention "
            f"normalises its q/kv latents with eps {MLA_LATENT_NORM_EPS} and the layers with "
            "rms_norm_eps, while Megatron applies one epsilon to every norm; use a config "
            f"with rms_norm_eps={MLA_LATENT_NORM_EPS} (as DeepSeek-V3 and Kimi-K2)"
        )
    q_lora = arch_field(arch, "q_lora_rank", 0)
    rope = arch["qk_rope_head_dim"]
    return {
        "q_lora_rank": q_lora or None,
        "kv_lora_rank": arch["kv_lora_rank"],
        "qk_head_dim": arch["head_dim"] - rope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": arch["v_head_dim"],
        "kv_channels": arch["v_head_dim"],
        "num_query_groups": arch["num_attention_heads"],
        "qk_layernorm": True,  # the q/kv latent norms (IdentityOp otherwise)
        "rotary_base": _rotary_base(arch["rope_theta"]),
        "rotary_percent": 1.0,
        **_mla_rope(arch),
    }


def _rotary_base(theta: float) -> int | float:
    return int(theta) if float(theta).is_integer() else theta


def _mla_rope(arch: Mapping[str, Any]) -> dict[str, Any]:
    raw = arch.get("rope_scaling")
    items: dict[str, Any] = dict(raw.items() if isinstance(raw, Mapping) else raw or ())
    kind = items.get("rope_type", items.get("type", "default"))
    if kind == "default":
        return {"rope_type": "rope", "rotary_scaling_factor": 1.0}
    if kind != "yarn":
        raise LayoutError(
            f"rope scaling {items} (rope_type={kind!r}): Megatron's multi-latent attention "
            "applies plain rope or yarn only; train this model with the fsdp backend"
        )
    mscale, all_dim = items.get("mscale", 1.0), items.get("mscale_all_dim")
    if all_dim is None and mscale != 1.0:
        raise LayoutError(
            f"yarn rope scaling {items} has mscale={mscale} without mscale_all_dim: "
            "transformers then scales by its default mscale and Megatron by this one; give "
            "mscale_all_dim or use mscale=1"
        )
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(items["factor"]),
        "original_max_position_embeddings": int(items["original_max_position_embeddings"]),
        "beta_fast": float(items.get("beta_fast", 32)),
        "beta_slow": float(items.get("beta_slow", 1)),
        "mscale": float(mscale),
        "mscale_all_dim": float(all_dim or 0.0),
    }


def _architecture_fields(arch: Mapping[str, Any]) -> dict[str, Any]:
    """The model's shape: sizes, heads, RMSNorm, SwiGLU, biases, q/k norms, no dropout."""
    heads = arch["num_attention_heads"]
    hidden = arch["hidden_size"]
    return dict(
        num_layers=arch["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=arch["num_key_value_heads"],
        kv_channels=arch_field(arch, "head_dim", hidden // heads),
        ffn_hidden_size=arch["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=arch["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(arch.get("qkv_bias", False)),
        qk_layernorm=bool(arch.get("qk_norm", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=arch_field(arch, "mtp_layers", 0) or None,
    )


def _moe_fields(arch: Mapping[str, Any], *, moe_grouped_gemm: bool) -> dict[str, Any]:
    """The MoE fields (none for a dense model): softmax top-k router, no load balancing."""
    num_experts = arch.get("num_experts")
    if not num_experts:
        return {}
    pattern = arch.get("moe_layer_pattern")
    return {
        "num_moe_experts": num_experts,
        "moe_ffn_hidden_size": arch["moe_intermediate_size"],
        "moe_router_topk": arch["num_experts_per_tok"],
        "moe_router_pre_softmax": not arch_field(arch, "norm_topk_prob", True),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": moe_grouped_gemm,
        "moe_layer_freq": 1 if pattern is None else [int(bool(x)) for x in pattern],
        "moe_router_dtype": "fp32",
        **_routing_fields(arch),
    }


def _routing_fields(arch: Mapping[str, Any]) -> dict[str, Any]:
    """Sigmoid scores with a fixed expert bias, group-limited top-k, scaling, shared experts."""
    score = arch_field(arch, "router_score", "softmax")
    if score == "sigmoid" and not arch_field(arch, "norm_topk_prob", True):
        raise SpecError(
            "router_score='sigmoid' with norm_topk_prob=False: Megatron-Core renormalises "
            "sigmoid top-k scores always, so this router would compute differently; use a "
            "model with norm_topk_prob=True"
        )
    groups = arch_field(arch, "router_groups", 1)
    shared = arch_field(arch, "num_shared_experts", 0)
    scale = arch_field(arch, "routed_scaling_factor", 1.0)
    return {
        "moe_router_score_function": score,
        "moe_router_enable_expert_bias": bool(arch_field(arch, "router_bias", False)),
        # the bias is a checkpoint value, not updated by a load-balancing rule
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": arch_field(arch, "router_group_topk", 1) if groups > 1 else None,
        "moe_router_topk_scaling_factor": scale if scale != 1.0 else None,
        "moe_shared_expert_intermediate_size": shared * arch["moe_intermediate_size"] or None,
    }


def _parallel_fields(
    sizes: MegatronSizes,
    *,
    num_layers_in_first_pipeline_stage: int | None,
    num_layers_in_last_pipeline_stage: int | None,
    pipeline_model_parallel_layout: str | None,
    pipeline_dtype: torch.dtype,
) -> dict[str, Any]:
    """The parallel sizes, no sequence parallelism, and the pipeline's stage split."""
    return dict(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        sequence_parallel=False,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        pipeline_model_parallel_layout=pipeline_model_parallel_layout,
        pipeline_dtype=pipeline_dtype,
    )


def _cpu_fields(params_dtype: torch.dtype) -> dict[str, Any]:
    """CPU: no fused kernels, ``params_dtype`` (fp32 by default), weights created on CPU."""
    return dict(
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=True,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # gloo matches same-peer p2p messages in posting order, and the interleaved
        # schedule posts both directions between two pipeline ranks in one batch in
        # opposite orders (pp=2): batched p2p would silently swap activations and
        # gradients. Unbatched p2p sends the two directions over different groups.
        batch_p2p_comm=not (dist.is_initialized() and dist.get_backend() == "gloo"),
    )
