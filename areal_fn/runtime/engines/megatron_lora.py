"""LoRA adapters in Megatron-Core ``GPTModel`` chunks, placed as ``with_lora`` places them.

:func:`inject_megatron_lora` gives every adapted Megatron linear layer (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``, local spec) two children holding this
rank's adapter shards, ``lora_A.weight`` and ``lora_B.weight`` (the layout's local
shapes, so the parameter names are the layout's), freezes every other parameter, and
adds the adapter's output to the layer's with a forward hook:

- column-parallel layer (``ColumnParallelLinear``: its output rows split over TP):
  ``u = lora_A x`` on the whole input (``lora_A`` replicated), ``u`` through Megatron's
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward: the
  TP ranks' partial gradients of ``u`` summed, so ``lora_A``'s gradient is whole on each
  rank), then each local row ``i`` of the output gains ``(alpha / r) * lora_B[i] .
  u[m(i)]``, ``m(i)`` the fused member the row belongs to
  (:func:`~areal_fn.layouts.lora.adapter_row_members`: q, k or v rows of ``linear_qkv``;
  gate or up of ``linear_fc1``), which is what PEFT's separate adapters compute;
- row-parallel layer (``RowParallelLinear``: its input columns split): ``u = lora_A x``
  on this rank's columns, summed over TP with ``reduce_from_tensor_model_parallel_region``
  (all-reduce forward, identity backward), then ``(alpha / r) * lora_B u`` added to the
  all-reduced output (``lora_B`` replicated).

The adapters start as PEFT starts them (:func:`initial_adapters`: ``lora_A``
Kaiming-uniform from a generator seeded ``seed + i`` for target ``i``, as
:class:`~areal_fn.runtime.engines.lora.LoraLinear` draws them; ``lora_B`` zero).
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.lora import adapter_row_members
from areal_fn.model.lora import LoraConfig, LoraError, lora_expert_targets, lora_targets
from areal_fn.model.spec import ModelSpec
from areal_fn.typecheck import beartype

__all__ = ["check_expert_lora", "initial_adapters", "inject_megatron_lora"]


class _Shard(nn.Module):
    """One adapter shard as a module's ``weight`` (so it is named ``<layer>.lora_A.weight``)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device))


@beartype
def check_expert_lora(config: LoraConfig | None, etp: int) -> None:
    """Refuse adapters on routed experts under expert tensor parallelism (pure)."""
    if config is not None and config.target_parameters and etp > 1:
        raise LoraError(
            f"LoraConfig.target_parameters with etp={etp}: Megatron-Core's expert layers "
            "under expert TP leave their output reduction to the token dispatcher, which "
            "the adapter hooks do not follow (measured: the loss off by 2e-3 from PEFT's); "
            "use etp=1 for expert adapters"
        )


@beartype
def initial_adapters(model: ModelSpec, config: LoraConfig, *, seed: int = 0) -> dict[str, Tensor]:
    """PEFT's initial adapters by canonical name: ``lora_A`` Kaiming-uniform (``a = sqrt(5)``)
    from a generator seeded ``seed + i`` for target ``i``, ``lora_B`` zero."""
    out: dict[str, Tensor] = {}
    for i, t in enumerate(lora_targets(model, config)):
        a = torch.empty(t.rank, t.in_features)
        nn.init.kaiming_uniform_(
            a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed + i)
        )
        out[t.lora_a] = a
        out[t.lora_b] = torch.zeros(t.out_features, t.rank)
    first = len(lora_targets(model, config))
    for i, x in enumerate(lora_expert_targets(model, config)):
        a = torch.empty(x.experts * x.rank, x.in_features)
        g = torch.Generator().manual_seed(seed + first + i)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        out[x.lora_a] = a
        out[x.lora_b] = torch.zeros(x.out_features, x.experts * x.rank)
    return out


def _column_hook(rank: int, members: Tensor, scaling: float) -> Any:
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    k = int(members.max()) + 1
    masks = [(members == m).to(torch.float32) for m in range(k)]

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
        out, bias = output
        x = args[0]
        u = copy_to_tensor_model_parallel_region(
            F.linear(x, module.lora_A.weight), group=module.tp_group
        )
        parts = u.reshape(*u.shape[:-1], k, rank)
        b = module.lora_B.weight
        lora = sum(F.linear(parts[..., m, :], b) * masks[m].to(out.device) for m in range(k))
        return (out + lora * scaling, bias)

    return hook


def _row_hook(scaling: float) -> Any:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
        out, bias = output
        u = reduce_from_tensor_model_parallel_region(
            F.linear(args[0], module.lora_A.weight), group=module.tp_group
        )
        return (out + F.linear(u, module.lora_B.weight) * scaling, bias)

    return hook


@beartype
def inject_megatron_lora(chunks: list[Any], layout: Layout, rank: int, config: LoraConfig) -> None:
    """Add this rank's adapters of ``layout`` (a ``with_lora`` Megatron layout) to the
    ``GPTModel`` ``chunks`` (before Megatron's ``DistributedDataParallel`` wraps them) and
    freeze every other parameter. ``LayoutError`` for an adapted module that is not a
    column- or row-parallel linear layer."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    shapes: Mapping[str, tuple[int, ...]] = {lt.name: lt.shape for lt in layout.local_tensors(rank)}
    vpp = len(chunks) > 1
    for name in [n for n in shapes if n.endswith(".lora_A.weight")]:
        stem = name.removesuffix(".lora_A.weight")
        b_name = stem + ".lora_B.weight"
        v, path = (int(stem.split(".", 1)[0][5:]), stem.split(".", 1)[1]) if vpp else (0, stem)
        module = chunks[v].get_submodule(path)
        r = shapes[b_name][1]  # lora_B's columns are never split
        device = next(module.parameters()).device
        module.lora_A = _Shard(shapes[name], device)
        module.lora_B = _Shard(shapes[b_name], device)
        allreduce = getattr(module.weight, "allreduce", True)  # False: an expert's (EDP)
        for p in (module.lora_A.weight, module.lora_B.weight):
            p.allreduce = allreduce  # type: ignore[attr-defined]
        scaling = float(config.alpha) / r
        if isinstance(module, ColumnParallelLinear):
            members = torch.tensor(adapter_row_members(layout, b_name, rank))
            module.register_forward_hook(_column_hook(r, members, scaling))
        elif isinstance(module, RowParallelLinear):
            module.register_forward_hook(_row_hook(scaling))
        else:
            raise LayoutError(
                f"{stem} is a {type(module).__name__}; LoRA adapters are placed beside "
                "ColumnParallelLinear and RowParallelLinear layers (Megatron's local spec)"
            )
