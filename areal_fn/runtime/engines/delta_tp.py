"""A gated delta net under tensor parallelism: each rank runs its key-head groups.

transformers' linear-attention module (Qwen3-Next, Qwen3.5) reshapes its projections by
the head counts it holds (``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim``),
so :class:`GatedDeltaNetParallel` runs the whole module on one rank's part
(:mod:`areal_fn.model.linear_tp`): during its forward every parameter of the module and
its children is swapped for the rank's part, and the head counts for the rank's:

- a parameter placed ``Shard(d)`` (``in_proj_qkvz``, ``in_proj_ba``, ``in_proj_z/b/a``,
  ``A_log``, ``dt_bias`` by rows, ``out_proj`` by columns) runs on its local shard, whose
  gradient is its own;
- a parameter placed ``Replicate()`` runs whole (the gated ``norm``) or on the rows of
  ``[q; k; v]`` the rank holds (``conv1d``, Qwen3.5's ``in_proj_qkv``: their role is
  ``TpRole.DELTA_QKV``); each rank's gradient is then partial and FSDP2 sums it over
  ``tp``.

The module's input is whole on every rank: its gradient, one part per rank, is summed
over ``tp`` in the backward; its output (``out_proj`` of the rank's value heads) is
summed over ``tp`` in the forward (Megatron's ``f`` and ``g``).
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import ParallelStyle

from areal_fn.errors import LayoutError
from areal_fn.model.linear_attention import LinearAttention
from areal_fn.model.linear_tp import delta_local_heads, delta_qkv_rows
from areal_fn.sharding.placement import Placement, Replicate, Shard

__all__ = ["GatedDeltaNetParallel", "delta_heads_of"]

#: The module attributes transformers' gated delta net reshapes by.
_HEAD_ATTRS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def delta_heads_of(config: Any) -> LinearAttention:
    """The head counts and sizes of a transformers config's linear-attention layers."""
    return LinearAttention(
        key_heads=int(config.linear_num_key_heads),
        value_heads=int(config.linear_num_value_heads),
        key_head_dim=int(config.linear_key_head_dim),
        value_head_dim=int(config.linear_value_head_dim),
        conv_kernel=int(config.linear_conv_kernel_dim),
        layers=(),
    )


class _SumInTp(torch.autograd.Function):
    """Forward: sum over the group; backward: identity (each rank's output is partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


class _SumGradInTp(torch.autograd.Function):
    """Forward: identity; backward: sum the gradient over the group (each rank's part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _torch_placement(p: Placement) -> Any:
    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, Replicate):
        return TReplicate()
    raise LayoutError(f"a gated delta net's parameter placed {p} over tp; use S(d) or R")


class GatedDeltaNetParallel(ParallelStyle):
    """A linear-attention module (and its children) run on one ``tp`` rank's heads.

    ``placements``: each parameter's ``tp`` placement, by its name under the module
    (``"conv1d.weight"``, ``"A_log"``); ``qkv_rows``: the replicated ones computed on the
    rank's ``[q; k; v]`` rows; ``heads``: the layer's head counts and sizes.
    """

    def __init__(
        self,
        *,
        placements: Mapping[str, Placement],
        qkv_rows: frozenset[str],
        heads: LinearAttention,
    ) -> None:
        super().__init__()
        self.placements = dict(placements)
        self.qkv_rows = qkv_rows
        self.heads = heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        k, v = delta_local_heads(self.heads, tp)
        h = self.heads
        local = {
            "num_k_heads": k,
            "num_v_heads": v,
            "key_dim": k * h.key_head_dim,
            "value_dim": v * h.value_head_dim,
            "conv_dim": 2 * k * h.key_head_dim + v * h.value_head_dim,
        }
        rows = torch.cat([torch.arange(a, b) for a, b in delta_qkv_rows(h, tp, rank)])
        for name, param in list(module.named_parameters()):
            owner_name, _, pname = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            dparam = nn.Parameter(
                distribute_tensor(
                    param.data, device_mesh, [_torch_placement(self.placements[name])]
                ),
                requires_grad=param.requires_grad,
            )
            owner.register_parameter(pname, dparam)
        group = device_mesh.get_group()
        saved: list[tuple[nn.Module, str, Any]] = []

        def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            for name, p in list(mod.named_parameters()):
                owner_name, _, pname = name.rpartition(".")
                owner = mod.get_submodule(owner_name)
                saved.append((owner, pname, p))
                owner._parameters[pname] = self._local(name, p, rows)
            for attr in _HEAD_ATTRS:
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, local[attr])
            if args:
                return (_SumGradInTp.apply(args[0], group), *args[1:]), kwargs
            kwargs["hidden_states"] = _SumGradInTp.apply(kwargs["hidden_states"], group)
            return args, kwargs

        def leave(mod: nn.Module, _args: Any, out: Any) -> Any:
            while saved:
                owner, name, value = saved.pop()
                if isinstance(value, nn.Parameter):
                    owner._parameters[name] = value
                else:
                    setattr(owner, name, value)
            return _SumInTp.apply(out, group) if isinstance(out, torch.Tensor) else None

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, always_call=True)
        return module

    def _local(self, name: str, p: Any, rows: torch.Tensor) -> Any:
        """Parameter ``name``'s part on this rank, as a plain tensor for the forward."""
        if not isinstance(p, DTensor):
            raise LayoutError(f"{name}: a gated delta net's parameter is not a DTensor over tp")
        if p.placements == (TReplicate(),):
            whole = p.to_local(grad_placements=(TPartial(),))
            return whole.index_select(0, rows) if name in self.qkv_rows else whole
        return p.to_local()

    def __repr__(self) -> str:
        return f"GatedDeltaNetParallel(qkv_rows={sorted(self.qkv_rows)})"
