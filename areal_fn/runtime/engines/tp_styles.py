"""The ``parallelize_module`` plan a layout's ``tp`` axis implies: DTensor parallel styles.

Every module with parameters gets a DTensor parallel style from its parameters'
placements on the ``tp`` axis: a ``Linear`` placed ``Shard(0)`` is ``ColwiseParallel``,
``Shard(1)`` is ``RowwiseParallel``, an ``Embedding`` placed ``Shard(0)`` (vocabulary)
is ``RowwiseParallel``, ``Shard(1)`` ``ColwiseParallel``, and a module whose parameters
are all ``Replicate()`` gets :class:`ReplicateParallel` (with partial gradients for a
per-head norm, ``TpRole.HEAD_NORM``, and the summed rope-key columns of
``TpRole.SHARED_ROPE_KEY``: each module's role in its family's table), a module of
head-split parameters (``TpRole.HEAD``) :class:`HeadShardParallel`, and a gated delta
net (its ``TpRole.DELTA_HEAD`` parameters) one
:class:`~areal_fn.runtime.engines.delta_tp.GatedDeltaNetParallel` for it and its children. Used by
:func:`~areal_fn.runtime.engines.fsdp2_apply.apply_fsdp2` (which re-exports these names)
and by the TP stand-in inference engine (:mod:`areal_fn.runtime.engines.tp`).
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
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import Layout
from areal_fn.model.families import FAMILIES
from areal_fn.model.families.roles import tp_role
from areal_fn.model.families.tp_role import TpRole
from areal_fn.model.spec import layer_of
from areal_fn.runtime.engines.delta_tp import GatedDeltaNetParallel, delta_heads_of
from areal_fn.runtime.engines.fsdp2_mesh import TP, layout_mesh
from areal_fn.runtime.engines.lora import lora_tp_plan
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Placement, Replicate, Shard
from areal_fn.typecheck import beartype

__all__ = [
    "HeadShardParallel",
    "ReplicateParallel",
    "module_placements",
    "param_names",
    "retie",
    "tensor_parallel_style",
    "tp_plan",
]


class ReplicateParallel(ParallelStyle):
    """Parameters as ``Replicate()`` DTensors over the TP mesh, computed on local views.

    The parameters become replicated DTensors (so that FSDP2 lays them on the same mesh
    as the TP-sharded ones); during the module's forward each is swapped for its local
    tensor, so the module runs on plain tensors (any op works, inputs and outputs stay
    local). ``partial_grads`` declares that each TP rank sees only part of the input
    (per-head norms over column-parallel heads): gradients then leave as ``Partial()``
    and FSDP2 sums them over ``tp``. Otherwise the input is replicated and every TP rank
    computes the same full gradient.
    """

    def __init__(
        self, *, partial_grads: bool = False, sum_output_grad: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.partial_grads = partial_grads
        self.sum_output_grad = sum_output_grad
        self._swapped: dict[int, dict[str, nn.Parameter]] = {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                if param.placements != (TReplicate(),):
                    raise LayoutError(
                        f"ReplicateParallel got a parameter {pname!r} already placed "
                        f"{param.placements}; tie it to a replicated parameter or shard its module"
                    )
                continue
            dparam = nn.Parameter(
                DTensor.from_local(param.data, device_mesh, [TReplicate()], run_check=False),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dparam)
        grads = (TPartial(),) if self.partial_grads else (TReplicate(),)
        return self._run_locally(module, device_mesh, grads)

    def _run_locally(
        self, module: nn.Module, device_mesh: DeviceMesh, grads: tuple[Any, ...]
    ) -> nn.Module:
        """Swap the module's DTensor parameters for their local tensors during its forward."""

        def to_local(mod: nn.Module, _args: Any) -> None:
            saved: dict[str, nn.Parameter] = {}
            for name, p in list(mod._parameters.items()):
                if isinstance(p, DTensor):
                    saved[name] = p
                    mod._parameters[name] = p.to_local(grad_placements=grads)  # type: ignore[assignment]
            self._swapped[id(mod)] = saved

        def restore(mod: nn.Module, _args: Any, out: Any) -> Any:
            mod._parameters.update(self._swapped.pop(id(mod), {}))
            if self.sum_output_grad is None or not torch.is_grad_enabled():
                return None
            return _SumGradColumns.apply(out, *self.sum_output_grad, device_mesh.get_group())

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module

    def __repr__(self) -> str:
        cols = "" if self.sum_output_grad is None else f", sum_output_grad={self.sum_output_grad}"
        return f"ReplicateParallel(partial_grads={self.partial_grads}{cols})"


class HeadShardParallel(ReplicateParallel):
    """Parameters sharded by attention head (``Shard(0)`` DTensors over the TP mesh),
    computed on their local shards: gpt-oss's attention sinks (one logit per head) beside
    column-wise q/k/v, where each TP rank runs its own heads. Each rank's gradient is
    that of its own shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            dparam = nn.Parameter(
                distribute_tensor(param.data, device_mesh, [TShard(0)]),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dparam)
        return self._run_locally(module, device_mesh, (TShard(0),))

    def __repr__(self) -> str:
        return "HeadShardParallel()"


class _SumGradColumns(torch.autograd.Function):
    """Identity forward; backward sums the gradient of columns ``lo:hi`` (last dim) over
    the TP group. Multi-latent attention's shared rope key (the last ``qk_rope_head_dim``
    columns of ``kv_a_proj_with_mqa``) feeds every head, and each TP rank computes its
    heads only, so each holds part of that gradient; the latent columns feed the
    column-parallel ``kv_b_proj``, whose input gradient DTensor already sums."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, lo: int, hi: int, group: Any) -> torch.Tensor:
        ctx.lo, ctx.hi, ctx.group = lo, hi, group
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.clone()
        part = grad[..., ctx.lo : ctx.hi].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.lo : ctx.hi] = part
        return grad, None, None, None


def param_names(model: nn.Module) -> dict[tuple[str, str], str]:
    """(module name, local parameter name) -> the parameter's name in ``named_parameters()``.

    A tied parameter (``lm_head.weight`` of a tied model) maps to its first name.
    """
    first: dict[int, str] = {}
    out: dict[tuple[str, str], str] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            out[(mname, pname)] = first.setdefault(id(param), full)
    return out


def _tp_placements(layout: Layout, mesh: Mesh) -> dict[str, Placement]:
    i = mesh.axis_index(TP)
    return {t.name: t.sharding.placements[i] for t in layout.tensors}


def tensor_parallel_style(
    mname: str, module: nn.Module, placements: Mapping[str, Placement]
) -> ParallelStyle:
    """The DTensor style of a Linear or Embedding whose parameters have these ``tp``
    placements: Linear ``S(0)`` column-wise (gathering its output outside decoder
    layers), ``S(1)`` row-wise (bias replicated), Embedding ``S(0)`` row-wise over the
    vocabulary with replicated input ids, ``S(1)`` column-wise."""
    weight = placements.get("weight")
    others = {n: p for n, p in placements.items() if n != "weight"}
    inside_layer = layer_of(mname + ".") is not None
    if isinstance(module, nn.Linear) and set(placements) <= {"weight", "bias"}:
        if weight == Shard(dim=0) and all(p == Shard(dim=0) for p in others.values()):
            return (
                ColwiseParallel() if inside_layer else ColwiseParallel(output_layouts=TReplicate())
            )
        if weight == Shard(dim=1) and all(isinstance(p, Replicate) for p in others.values()):
            return RowwiseParallel()
    if isinstance(module, nn.Embedding) and set(placements) == {"weight"}:
        if weight == Shard(dim=0):
            return RowwiseParallel(input_layouts=TReplicate())
        if weight == Shard(dim=1):
            return ColwiseParallel()
    described = ", ".join(f"{n}: {p}" for n, p in placements.items())
    raise LayoutError(
        f"no tensor-parallel style fits module {mname!r} ({type(module).__name__}) with tp "
        f"placements {{{described}}}; the runtime supports Linear S(0) (column-wise) / S(1) "
        "(row-wise, bias R), Embedding S(0)/S(1), and modules whose parameters are all R"
    )


def module_placements(
    model: nn.Module, by_name: Mapping[str, Placement], *, remedy: str, kind: str
) -> dict[str, dict[str, Placement]]:
    """``tp`` placements grouped by module: module name -> {parameter attribute: placement}.

    Every model parameter must be in ``by_name`` (a tied one under its first name);
    otherwise ``LayoutError`` lists the missing ones and says ``remedy``.
    """
    names = param_names(model)
    missing = sorted({n for n in names.values() if n not in by_name})
    if missing:
        raise LayoutError(f"model parameters {missing[:5]} are not in the {kind} layout; {remedy}")
    grouped: dict[str, dict[str, Placement]] = {}
    for (mname, pname), name in names.items():
        grouped.setdefault(mname, {})[pname] = by_name[name]
    return grouped


def _module_role(config: Any, mname: str, placements: Mapping[str, Placement]) -> TpRole:
    """The role its family's table gives every parameter of module ``mname`` (one role
    for all of them, else ``REPLICATE``; ``REPLICATE`` for a model of no known family)."""
    family = FAMILIES.get(getattr(config, "model_type", None) or "")
    if family is None:
        return TpRole.REPLICATE
    roles = {tp_role(family, f"{mname}.{p}") for p in placements}
    return roles.pop() if len(roles) == 1 else TpRole.REPLICATE


def _style(
    mname: str, module: nn.Module, placements: Mapping[str, Placement], config: Any
) -> ParallelStyle:
    role = _module_role(config, mname, placements)
    if role is TpRole.HEAD and all(p == Shard(dim=0) for p in placements.values()):
        return HeadShardParallel()  # gpt-oss: the sinks of this rank's heads
    if all(isinstance(p, Replicate) for p in placements.values()):
        cols = None
        if role is TpRole.SHARED_ROPE_KEY and isinstance(module, nn.Linear):
            cols = (int(config.kv_lora_rank), module.out_features)
        return ReplicateParallel(partial_grads=role is TpRole.HEAD_NORM, sum_output_grad=cols)
    return tensor_parallel_style(mname, module, placements)


@beartype
def tp_plan(model: nn.Module, layout: Layout) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) the layout's ``tp`` axis implies.

    Empty when the layout has no ``tp`` axis. Module order is ``named_modules()`` order.
    A LoRA layer (:class:`~areal_fn.runtime.engines.lora.LoraLinear`) split over ``tp``
    gets one style for its base and adapters (:func:`~areal_fn.runtime.engines.lora.lora_tp_plan`).
    """
    mesh = layout_mesh(layout)
    if TP not in mesh.names:
        return {}
    grouped = module_placements(
        model,
        _tp_placements(layout, mesh),
        kind=layout.kind,
        remedy="build the layout from this model's config (model_from_hf_config(model.config.to_dict()))",
    )
    plan: dict[str, ParallelStyle] = {}
    config = getattr(model, "config", None)
    inside = None  # a gated delta net's children: its own style runs them
    for mname, module in model.named_modules():
        if inside is not None and mname.startswith(inside):
            continue
        if mname in grouped and _module_role(config, mname, grouped[mname]) is TpRole.DELTA_HEAD:
            plan[mname], inside = _delta_style(config, mname, module, grouped), mname + "."
        elif mname in grouped:
            plan[mname] = _style(mname, module, grouped[mname], config)
    return lora_tp_plan(model, plan)


def _delta_style(
    config: Any, mname: str, module: nn.Module, grouped: Mapping[str, Mapping[str, Placement]]
) -> GatedDeltaNetParallel:
    """The style of a linear-attention module: its parameters and its children's (module
    role ``TpRole.DELTA_HEAD``; ``TpRole.DELTA_QKV`` ones on the rank's ``[q; k; v]`` rows)."""
    family = FAMILIES[config.model_type]
    placements: dict[str, Placement] = {}
    for sub, _m in module.named_modules():  # LoRA targets no linear-attention module
        full = f"{mname}.{sub}" if sub else mname
        for pname, placement in grouped.get(full, {}).items():
            placements[f"{sub}.{pname}" if sub else pname] = placement
    rows = frozenset(n for n in placements if tp_role(family, f"{mname}.{n}") is TpRole.DELTA_QKV)
    return GatedDeltaNetParallel(placements=placements, qkv_rows=rows, heads=delta_heads_of(config))


def retie(model: nn.Module, names: Mapping[tuple[str, str], str]) -> None:
    """Point every alias (tied weight) at the parameter its first name now holds."""
    for (mname, pname), name in names.items():
        full = f"{mname}.{pname}" if mname else pname
        if full != name:
            module = model.get_submodule(mname)
            module.register_parameter(pname, model.get_parameter(name))
