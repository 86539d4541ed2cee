"""Checks of a spec's rotary fraction and group-limited routing (used by ``ModelSpec``)."""

from typing import Any

from areal_fn.errors import SpecError

#: How a router turns logits into expert scores.
ROUTER_SCORES = ("softmax", "sigmoid")


def check_rotary(spec: Any) -> None:
    """``rotary_fraction`` of a :class:`~areal_fn.model.spec.ModelSpec`: 1 unless the
    family rotates part of each head, then an even whole number of dims."""
    f = spec.rotary_fraction
    if f == 1.0:
        return
    if not spec.family.partial_rotary:
        raise SpecError(
            f"rotary_fraction={f}: the {spec.model_type} family rotates every head dim; use "
            f"1.0 or a family with partial rotary embeddings (glm4_moe)"
        )
    dims = spec.head_dim * f
    if not 0 < f < 1 or dims != int(dims) or int(dims) % 2:
        raise SpecError(
            f"rotary_fraction={f} of head_dim={spec.head_dim} is {dims} dims; it must be in "
            f"(0, 1] and give an even whole number of rotated dims"
        )


def check_groups(spec: Any) -> None:
    """Group-limited routing of a :class:`~areal_fn.model.spec.ModelSpec`: equal groups,
    enough experts in the kept ones."""
    g, k = spec.router_groups, spec.router_group_topk
    if spec.num_experts % g or k > g:
        raise SpecError(
            f"router_groups={g} must divide num_experts={spec.num_experts} and "
            f"router_group_topk={k} must be <= router_groups; group-limited routing keeps "
            f"the top {k} of {g} equal groups of experts"
        )
    if spec.num_experts_per_tok > spec.num_experts // g * k:
        raise SpecError(
            f"num_experts_per_tok={spec.num_experts_per_tok} exceeds the "
            f"{spec.num_experts // g * k} experts in the top {k} of {g} groups"
        )
