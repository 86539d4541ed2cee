"""The cross-field rules of a :class:`~areal_fn.model.spec.ModelSpec` (its validator):
grouped-query heads, rotary dims, the family's fixed fields and layer pattern, routing."""

from typing import Any

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.dsa import check_dsa
from areal_fn.model.families.mapping import LayerKind
from areal_fn.model.linear_attention import check_linear
from areal_fn.model.mla import check_mla
from areal_fn.model.routing import check_groups, check_rotary


def _check_family_shape(spec: Any) -> None:
    """What the family's tables and config class imply: which layers are MoE, which
    fields are one field under two names."""
    fam = spec.family
    if fam.moe and not any(r.layers is LayerKind.DENSE for r in fam.canonical):
        if not all(spec.moe_layers):
            raise SpecError(
                f"ModelSpec.moe_layers={spec.moe_layers} has dense layers, but every "
                f"{fam.model_type} layer is an MoE layer (the family has no dense MLP)"
            )
    n = len(spec.moe_layers)
    if fam.first_k_dense and n:
        k = spec.moe_layers.index(True) if any(spec.moe_layers) else n
        if k == n or spec.moe_layers != (False,) * k + (True,) * (n - k):
            raise SpecError(
                f"ModelSpec.moe_layers={spec.moe_layers}: {fam.model_type} layers are dense "
                f"first ({fam.first_k_dense}), then MoE to the last layer, with at least one "
                "MoE layer"
            )
    spec_fields = {f.name for f in attrs.fields(type(spec))}
    for key, source in fam.key_sources:
        if {key, source} <= spec_fields and getattr(spec, key) != getattr(spec, source):
            raise SpecError(
                f"ModelSpec.{key}={getattr(spec, key)} but {source}={getattr(spec, source)}; "
                f"the {fam.model_type} family has no separate {key} (it is {source})"
            )


def _check_window_and_swiglu(spec: Any) -> None:
    """Sliding-window layers and clamped SwiGLU experts: where the family models them."""
    fam, n = spec.family, spec.num_layers
    if fam.sliding_window == "layer_types":
        if len(spec.sliding_layers) != n:
            raise SpecError(
                f"ModelSpec.sliding_layers has {len(spec.sliding_layers)} entries but "
                f"num_layers={n}; {fam.model_type} gives one bool per layer (True: the layer "
                "attends to a sliding window)"
            )
        if spec.sliding_window < 1:
            raise SpecError(
                f"ModelSpec.sliding_window={spec.sliding_window}: {fam.model_type} needs a "
                "window >= 1 (its sliding layers attend to that many tokens)"
            )
    elif spec.sliding_window or any(spec.sliding_layers):
        raise SpecError(
            f"ModelSpec.sliding_window={spec.sliding_window}, sliding_layers="
            f"{spec.sliding_layers}: the {fam.model_type} family models full causal attention "
            "only; leave them at 0 and ()"
        )
    given = (spec.swiglu_alpha, spec.swiglu_limit)
    if fam.clamped_swiglu and None in given:
        raise SpecError(
            f"ModelSpec.swiglu_alpha, swiglu_limit = {given}: {fam.model_type} experts apply a "
            "clamped SwiGLU and need both"
        )
    if not fam.clamped_swiglu and given != (None, None):
        raise SpecError(
            f"ModelSpec.swiglu_alpha, swiglu_limit = {given}: the {fam.model_type} family's "
            "MLP is a plain SwiGLU; leave them None"
        )


def _check_layer_rope(spec: Any) -> None:
    """A local rope base and an attention scalar only where the family has them."""
    fam = spec.family
    local = fam.has_default("rope_local_base_freq")
    if local != (spec.rope_local_theta is not None):
        raise SpecError(
            f"ModelSpec.rope_local_theta={spec.rope_local_theta}: {fam.model_type} "
            + (
                "rotates its sliding layers with a base of their own; give it"
                if local
                else "rotates every layer with rope_theta; leave it None"
            )
        )
    if fam.attn_scalar != (spec.query_pre_attn_scalar > 0):
        raise SpecError(
            f"ModelSpec.query_pre_attn_scalar={spec.query_pre_attn_scalar}: {fam.model_type} "
            + (
                "scales attention by query_pre_attn_scalar ** -0.5; give it (>= 1)"
                if fam.attn_scalar
                else "scales attention by head_dim ** -0.5; leave it 0"
            )
        )


def _check_mtp(spec: Any) -> None:
    """Multi-token-prediction layers only for the families that have them."""
    if spec.mtp_layers and not spec.family.mtp:
        from areal_fn.model.mtp import mtp_families

        raise SpecError(
            f"mtp_layers={spec.mtp_layers}: {spec.model_type} has no multi-token-prediction "
            f"layers (families with them: {', '.join(mtp_families())}); use mtp_layers=0"
        )


def check_model(spec: Any) -> None:
    fam = spec.family
    _check_family_shape(spec)
    _check_mtp(spec)
    _check_window_and_swiglu(spec)
    _check_layer_rope(spec)
    check_linear(spec)
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    if heads % kv:
        raise SpecError(
            f"num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
            f"grouped-query attention needs num_attention_heads % num_key_value_heads == 0"
        )
    if spec.head_dim % 2 and not fam.mla:  # MLA rotates qk_rope_head_dim (check_mla)
        raise SpecError(
            f"head_dim={spec.head_dim} is odd; rotary embeddings rotate pairs of dims, "
            f"so head_dim must be even"
        )
    if fam.hidden_divisible_by_heads and spec.hidden_size % heads:
        raise SpecError(
            f"hidden_size={spec.hidden_size} is not divisible by num_attention_heads={heads}; "
            f"{fam.model_type} requires it (transformers rejects such a config) even with an "
            f"explicit head_dim"
        )
    for name, value in fam.fixed:
        if getattr(spec, name) != value:
            raise SpecError(
                f"{fam.model_type} has {name}={value!r} by construction, got {name}="
                f"{getattr(spec, name)!r}; use a family whose config can express it"
            )
    for key, fields in fam.bias_flags:
        values = {f: getattr(spec, f) for f in fields}
        if len(set(values.values())) > 1:
            raise SpecError(
                f"{fam.model_type} sets {' and '.join(fields)} together from config key "
                f"{key!r}, got {values}; make them equal"
            )
    if len(spec.moe_layers) != spec.num_layers:
        raise SpecError(
            f"moe_layers has {len(spec.moe_layers)} entries but num_layers={spec.num_layers}; "
            f"give one bool per layer"
        )
    moe = (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size)
    check_rotary(spec)
    check_mla(spec)
    check_dsa(spec)
    routing = (
        spec.num_shared_experts,
        spec.router_score,
        spec.router_bias,
        spec.router_groups,
        spec.router_group_topk,
        spec.routed_scaling_factor,
    )
    if not fam.moe and routing != (0, "softmax", False, 1, 1, 1.0):
        raise SpecError(
            f"{fam.model_type} is a dense family but its routing fields (num_shared_experts, "
            f"router_score, router_bias, router_groups, router_group_topk, "
            f"routed_scaling_factor) = {routing}; leave them at their defaults"
        )
    if not fam.moe:
        if any(moe) or spec.norm_topk_prob or any(spec.moe_layers):
            raise SpecError(
                f"{fam.model_type} is a dense family but num_experts, num_experts_per_tok, "
                f"moe_intermediate_size = {moe}, norm_topk_prob={spec.norm_topk_prob}, "
                f"moe_layers has {sum(spec.moe_layers)} MoE layer(s); use zeros/False or an "
                f"MoE family such as qwen3_moe"
            )
        return
    if spec.num_experts < 1 or spec.moe_intermediate_size < 1:
        raise SpecError(
            f"{fam.model_type} needs num_experts >= 1 and moe_intermediate_size >= 1, got "
            f"num_experts={spec.num_experts}, moe_intermediate_size={spec.moe_intermediate_size}"
        )
    if not 1 <= spec.num_experts_per_tok <= spec.num_experts:
        raise SpecError(
            f"num_experts_per_tok={spec.num_experts_per_tok} must be in 1..num_experts="
            f"{spec.num_experts}; a token cannot be routed to more experts than exist"
        )
    check_groups(spec)
