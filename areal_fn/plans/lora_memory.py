"""Per-rank memory of LoRA training: a frozen base, trained adapters.

:func:`estimate_lora_memory` takes the base model's layout (or census) and the
adapters' (:func:`~areal_fn.layouts.lora.adapter_layout`) and counts:

- the frozen base: its parameters only, in the policy's ``param_dtype`` (no gradients,
  no master copy, no optimizer state: nothing steps them);
- the adapters: parameters, gradients and optimizer state exactly as
  :func:`~areal_fn.plans.memory.estimate_memory` counts a trained layout (master copy,
  Adam's moments and ``step``; Megatron's distributed optimizer shards them over data
  parallelism);
- activations and FSDP2 buffers (with an ``activation`` model) as for the base model's
  full training: backward still runs through every frozen layer to reach the adapters
  below it; the adapters' own ``r``-wide activations are left out, and FSDP2's buffers
  still count one unit's gradient in flight (an upper bound: a frozen unit has none).
"""

from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lora import adapter_layout
from areal_fn.model.lora import LoraConfig
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.census import Census, census_of
from areal_fn.plans.memory import (
    ActivationModel,
    MemoryReport,
    PrecisionPolicy,
    RankMemory,
    estimate_memory,
)
from areal_fn.strategy.allocation import Component
from areal_fn.strategy.coerce import Strategy
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
    """The census of ``config``'s adapters under one training component's layout."""
    return census_of(adapter_layout(layout_for(model, component), model, config))


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
    arguments are :func:`~areal_fn.plans.memory.estimate_memory`'s."""
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
