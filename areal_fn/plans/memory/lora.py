"""Per-rank memory of LoRA training: a frozen base, trained adapters.

:func:`estimate_lora_memory` takes the base model's layout (or census) and the
adapters' (:func:`~areal_fn.layouts.lora.adapter_layout`) and counts:

- the frozen base: its parameters only, in the policy's ``param_dtype`` (no gradients,
  no master copy, no optimizer state: nothing steps them);
- the adapters: parameters, gradients and optimizer state exactly as
  :func:`~areal_fn.plans.memory.estimate.estimate_memory` counts a trained layout (master copy,
  Adam's moments and ``step``; Megatron's distributed optimizer shards them over data
  parallelism);
- activations and FSDP2 buffers (with an ``activation`` model) as for the base model's
  full training: backward still runs through every frozen layer to reach the adapters
  below it; the adapters' own ``r``-wide activations are left out, and FSDP2's buffers
  still count one unit's gradient in flight (an upper bound: a frozen unit has none).
"""

import functools
from collections.abc import Sequence

import attrs

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lora import adapter_layout, adapter_shardings
from areal_fn.layouts.megatron import MegatronMeshes, layer_parameters, stages_for
from areal_fn.model.lora import LoraConfig, lora_targets
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.advisor.census import Census, TensorGroup, census_of
from areal_fn.plans.memory.estimate import (
    ActivationModel,
    MemoryReport,
    PrecisionPolicy,
    RankMemory,
    estimate_memory,
)
from areal_fn.sharding.placement import Placement, Replicate
from areal_fn.sharding.sharding import Sharding
from areal_fn.strategy.allocation import Backend, Component
from areal_fn.strategy.coerce import Strategy, as_component
from areal_fn.strategy.rules import check_dims
from areal_fn.typecheck import beartype


@beartype
def lora_rows(
    frozen: Sequence[RankMemory], trained: Sequence[RankMemory]
) -> tuple[RankMemory, ...]:
    """Rows of LoRA training from the base's rows (as if fully trained) and the adapters'
    rows of the same ranks: the base's parameters, activations and buffers, plus the
    adapters' parameters, gradients and optimizer state."""
    out = []
    for f, t in zip(frozen, trained, strict=True):
        if f.rank != t.rank:
            raise SpecError(f"lora_rows: rows of ranks {f.rank} and {t.rank}; pass the same ranks")
        out.append(
            attrs.evolve(f, params=f.params + t.params, grads=t.grads, optimizer=t.optimizer)
        )
    return tuple(out)


__all__ = ["estimate_lora_memory", "lora_adapter_census", "lora_rows"]

_BF16_MIXED = PrecisionPolicy.bf16_mixed()


@beartype
def lora_adapter_census(model: ModelSpec, component: Component | str, config: LoraConfig) -> Census:
    """The census of ``config``'s adapters under one training component's layout:
    ``census_of(adapter_layout(layout_for(model, component), model, config))``, computed
    for a Megatron component without building the layout (its routed experts make a big
    MoE model's layout take seconds), unless ``config`` adapts the routed experts."""
    comp = as_component(component, caller="lora_adapter_census")
    if comp.backend is not Backend.MEGATRON or config.target_parameters:
        return census_of(adapter_layout(layout_for(model, comp), model, config))
    dims = comp.dims
    check_dims(model, "megatron", dims)
    plan = stages_for(model, dims)
    dense = MegatronMeshes.of(dims).dense
    kinds = _layer_adapters(model, config)
    counts: dict[tuple[tuple[int, ...], Sharding, tuple[tuple[str, int], ...]], int] = {}
    for chunk in range(plan.num_chunks):
        present = (("pp", chunk % dims.pp),)
        for layer in plan.chunk_layers(chunk):
            for tp, a_shape, b_shape in kinds[model.moe_layers[layer]]:
                base = Sharding(mesh=dense, placements=(Replicate(),) * 3 + (tp,))
                shardings = adapter_shardings("", base)
                for shape, sharding in zip((a_shape, b_shape), shardings, strict=True):
                    key = (shape, sharding, present)
                    counts[key] = counts.get(key, 0) + 1
    groups = [
        TensorGroup(shape=k[0], sharding=k[1], present=k[2], count=n) for k, n in counts.items()
    ]
    return Census(kind="megatron", world_size=dense.size, groups=groups)


@functools.lru_cache(maxsize=16)
def _layer_adapters(
    model: ModelSpec, config: LoraConfig
) -> dict[bool, tuple[tuple[Placement, tuple[int, int], tuple[int, int]], ...]]:
    """Per layer kind (MoE or not): each adapted Megatron parameter's TP placement and its
    ``lora_A`` and ``lora_B`` shapes (every layer of a kind has the same parameters)."""
    targets = {t.base: t for t in lora_targets(model, config)}
    out = {}
    for moe in sorted(set(model.moe_layers[: model.num_layers])):
        layer = model.moe_layers.index(moe)
        rows = []
        for rec, shape in layer_parameters(model, layer):
            sources = [f"model.layers.{layer}.{h}" for h in rec.hf]
            members = [targets[s] for s in sources if s in targets]
            if rec.expert or not members:
                continue
            name = rec.name("local")
            if len(members) != len(sources):
                raise LayoutError(
                    f"{name} fuses {sources}; LoRA targets {[m.base for m in members]} of them "
                    "but not the others: target all of its modules or none"
                )
            if len({m.rank for m in members}) > 1:
                raise LayoutError(
                    f"{name} fuses {sources} whose adapters have ranks {[m.rank for m in members]}; "
                    "a fused tensor's adapters share one rank: give its modules one rank "
                    "(module_ranks)"
                )
            r, cols = members[0].rank, members[0].in_features
            rows.append((rec.tp, (len(members) * r, cols), (shape[0], r)))
        out[moe] = tuple(rows)
    return out


@beartype
def estimate_lora_memory(
    base: Layout | Census,
    adapters: Layout | Census,
    policy: PrecisionPolicy = _BF16_MIXED,
    *,
    activation: ActivationModel | None = None,
    model: ModelSpec | None = None,
    dims: Strategy | None = None,
    distributed_optimizer: bool = True,
    optimizer_offload: bool = False,
) -> MemoryReport:
    """Every rank's memory for LoRA training (see the module docstring): ``base`` is the
    frozen model's layout, ``adapters`` the adapters' under the same strategy. The other
    arguments are :func:`~areal_fn.plans.memory.estimate.estimate_memory`'s."""
    frozen_census = base if isinstance(base, Census) else census_of(base)
    trained_census = adapters if isinstance(adapters, Census) else census_of(adapters)
    if frozen_census.kind == "inference":
        raise SpecError(
            "estimate_lora_memory: an inference layout trains nothing; LoRA memory is that of a "
            "training layout (fsdp2 or megatron)"
        )
    if (trained_census.kind, trained_census.world_size) != (
        frozen_census.kind,
        frozen_census.world_size,
    ):
        raise SpecError(
            f"estimate_lora_memory: the adapters' {trained_census.kind} layout of "
            f"{trained_census.world_size} ranks is not the base's {frozen_census.kind} layout of "
            f"{frozen_census.world_size}; build both from one strategy (adapter_layout)"
        )
    frozen = estimate_memory(
        frozen_census,
        policy,
        activation=activation,
        model=model,
        dims=dims,
        distributed_optimizer=distributed_optimizer,
        optimizer_offload=optimizer_offload,
    )
    trained = estimate_memory(
        trained_census,
        policy,
        distributed_optimizer=distributed_optimizer,
        optimizer_offload=optimizer_offload,
    )
    return attrs.evolve(frozen, rows=lora_rows(frozen.rows, trained.rows))
