"""Apply an FSDP2 (+ DTensor TP, + HSDP) :class:`~areal_fn.layouts.layout.Layout` to a real model.

The runtime never computes a layout: it reads the one :func:`~areal_fn.layouts.fsdp2.fsdp2_layout`
made and performs it on a transformers model, under ``torchrun`` (gloo on CPU, NCCL on GPU)::

    layout = fsdp2_layout(spec, dims, options=Fsdp2Options(hsdp_replicas=2))  # pure
    device_mesh = init_mesh(layout.meshes[0])                                 # process groups
    model = apply_fsdp2(model, layout, device_mesh)                           # TP, then FSDP2
    load_canonical(model, layout, rank, canonical)                            # write pieces
    ...
    canonical = export_canonical(model, layout)                               # gather pieces

What each step reads from the layout:

- **mesh**: :func:`init_mesh` builds the ``DeviceMesh`` with the layout mesh's axis names
  and sizes (``dp_replicate`` when HSDP, ``dp_shard``, ``tp`` when > 1), row-major like
  our :class:`~areal_fn.sharding.mesh.Mesh`.
- **TP plan**: every module with parameters gets a DTensor parallel style from its
  parameters' placements on the ``tp`` axis: a ``Linear`` placed ``Shard(0)`` is
  ``ColwiseParallel``, ``Shard(1)`` is ``RowwiseParallel``, an ``Embedding`` placed
  ``Shard(0)`` (vocabulary) is ``RowwiseParallel``, ``Shard(1)`` ``ColwiseParallel``, and
  a module whose parameters are all ``Replicate()`` gets :class:`ReplicateParallel`
  (its parameters become replicated DTensors so that FSDP2 lays them on the same 2-D
  mesh as the rest). Activation layouts are not in a layout; they follow fixed rules:
  column-wise outputs stay sharded inside decoder layers and are gathered outside
  them (full logits for the loss); replicated modules compute on local tensors, and
  the per-head ``q_norm``/``k_norm``, which see only their rank's heads, hand their
  gradients to FSDP2 as partial sums that it reduces over ``tp``.
- **FSDP2**: ``fully_shard`` on every decoder layer named in the layout, then on the
  root, over ``dp_shard`` (or ``(dp_replicate, dp_shard)`` for HSDP), sharding the dim
  the layout's ``dp_shard`` placement names.

:func:`apply_fsdp2` then checks every parameter against the layout (DTensor mesh,
placements, local shape) and raises :class:`FSDP2MismatchError` on any difference.
:func:`load_canonical` and :func:`export_canonical` move data by the layout's pieces
only, so both are bitwise exact whenever the layout describes the data.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Placement as TPlacement
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from areal_fn.errors import ConversionError, LayoutError, SpecError
from areal_fn.layouts.layout import Layout, LocalTensor, LogicalTensor
from areal_fn.model.spec import layer_of
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Partial, Placement, Replicate, Shard, StridedShard
from areal_fn.typecheck import beartype

__all__ = [
    "FSDP2MismatchError",
    "Fsdp2RunOptions",
    "ReplicateParallel",
    "apply_fsdp2",
    "check_applied",
    "export_canonical",
    "init_mesh",
    "load_canonical",
    "materialize_local",
    "torch_placement",
    "torch_placements",
    "tp_plan",
]

#: Axis names of an FSDP2 layout mesh (see :func:`~areal_fn.layouts.fsdp2.fsdp2_mesh`).
DP_REPLICATE, DP_SHARD, TP = "dp_replicate", "dp_shard", "tp"
_AXES = (DP_REPLICATE, DP_SHARD, TP)
#: Modules whose input is sharded over attention heads (dim -2) under TP.
_HEAD_SHARDED_INPUT = ("self_attn.q_norm", "self_attn.k_norm")

_DTYPES = ("float32", "bfloat16", "float16", "float64")


class FSDP2MismatchError(RuntimeError):
    """The module FSDP2 built does not hold what the layout says (mesh, placement, shape)."""


def _dtype_or_none(_inst: object, attr: "attrs.Attribute[str | None]", value: str | None) -> None:
    if value is not None and value not in _DTYPES:
        raise SpecError(f"Fsdp2RunOptions.{attr.name}={value!r} is not one of {_DTYPES} or None")


@attrs.frozen(kw_only=True)
class Fsdp2RunOptions:
    """How the runtime applies FSDP2 (choices that do not change the layout).

    ``param_dtype``/``reduce_dtype``: FSDP2 mixed precision (``None`` keeps the
    parameters' dtype). ``cpu_offload``: keep sharded parameters, gradients and
    optimizer state on the CPU (``CPUOffloadPolicy``; on a CPU mesh the data is
    already there). ``activation_checkpointing``: recompute each decoder layer in
    backward (transformers' activation checkpointing, non-reentrant). ``reshard_after_forward``: free unsharded parameters after forward.
    """

    param_dtype: str | None = attrs.field(default=None, validator=_dtype_or_none)
    reduce_dtype: str | None = attrs.field(default=None, validator=_dtype_or_none)
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True

    def mixed_precision(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=getattr(torch, self.param_dtype) if self.param_dtype else None,
            reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype else None,
        )

    def offload(self) -> OffloadPolicy:
        return CPUOffloadPolicy(pin_memory=False) if self.cpu_offload else OffloadPolicy()


# -- placements ------------------------------------------------------------------------
def torch_placement(p: Placement) -> TPlacement:
    """The DTensor placement equal to our placement ``p``."""
    if isinstance(p, Replicate):
        return TReplicate()
    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Partial):
        return TPartial(p.op)
    raise TypeError(f"not a placement: {p!r}")


def torch_placements(placements: Sequence[Placement]) -> tuple[TPlacement, ...]:
    return tuple(torch_placement(p) for p in placements)


# -- mesh ------------------------------------------------------------------------------
@beartype
def init_mesh(mesh: Mesh, *, device_type: str = "cpu") -> DeviceMesh:
    """The ``DeviceMesh`` of ``mesh`` (same axis names, sizes and row-major rank order).

    Needs an initialised default process group of ``mesh.size`` ranks.
    """
    world = dist.get_world_size()
    if world != mesh.size:
        raise LayoutError(
            f"{mesh} has {mesh.size} ranks but the process group has {world}; launch "
            f"{mesh.size} processes or plan for {world} ranks"
        )
    return init_device_mesh(device_type, mesh.sizes, mesh_dim_names=mesh.names)


def _layout_mesh(layout: Layout) -> Mesh:
    meshes = layout.meshes
    if len(meshes) != 1:
        raise LayoutError(
            f"an FSDP2 layout has one mesh, this {layout.kind} layout has {len(meshes)}: "
            f"{[str(m) for m in meshes]}; build it with fsdp2_layout"
        )
    mesh = meshes[0]
    unknown = [n for n in mesh.names if n not in _AXES]
    if unknown or DP_SHARD not in mesh.names:
        raise LayoutError(
            f"{mesh} is not an FSDP2 mesh: axes must be drawn from {_AXES} and include "
            f"{DP_SHARD!r}; build the layout with fsdp2_layout"
        )
    return mesh


def _check_device_mesh(mesh: Mesh, device_mesh: DeviceMesh) -> None:
    names = tuple(device_mesh.mesh_dim_names or ())
    if names != mesh.names or tuple(device_mesh.shape) != mesh.sizes:
        raise LayoutError(
            f"device mesh {names}={tuple(device_mesh.shape)} is not the layout's {mesh}; "
            "build it with init_mesh(layout.meshes[0])"
        )


# -- tensor parallelism ----------------------------------------------------------------
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

    def __init__(self, *, partial_grads: bool = False) -> None:
        super().__init__()
        self.partial_grads = partial_grads
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

        def to_local(mod: nn.Module, _args: Any) -> None:
            saved: dict[str, nn.Parameter] = {}
            for name, p in list(mod._parameters.items()):
                if isinstance(p, DTensor):
                    saved[name] = p
                    mod._parameters[name] = p.to_local(grad_placements=grads)  # type: ignore[assignment]
            self._swapped[id(mod)] = saved

        def restore(mod: nn.Module, _args: Any, _out: Any) -> None:
            mod._parameters.update(self._swapped.pop(id(mod), {}))

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"ReplicateParallel(partial_grads={self.partial_grads})"


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


def _style(mname: str, module: nn.Module, placements: Mapping[str, Placement]) -> ParallelStyle:
    if all(isinstance(p, Replicate) for p in placements.values()):
        return ReplicateParallel(partial_grads=mname.endswith(_HEAD_SHARDED_INPUT))
    return tensor_parallel_style(mname, module, placements)


@beartype
def tp_plan(model: nn.Module, layout: Layout) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) the layout's ``tp`` axis implies.

    Empty when the layout has no ``tp`` axis. Module order is ``named_modules()`` order.
    """
    mesh = _layout_mesh(layout)
    if TP not in mesh.names:
        return {}
    grouped = module_placements(
        model,
        _tp_placements(layout, mesh),
        kind=layout.kind,
        remedy="build the layout from this model's config (model_from_hf_config(model.config.to_dict()))",
    )
    plan: dict[str, ParallelStyle] = {}
    for mname, module in model.named_modules():
        if mname in grouped:
            plan[mname] = _style(mname, module, grouped[mname])
    return plan


def retie(model: nn.Module, names: Mapping[tuple[str, str], str]) -> None:
    """Point every alias (tied weight) at the parameter its first name now holds."""
    for (mname, pname), name in names.items():
        full = f"{mname}.{pname}" if mname else pname
        if full != name:
            module = model.get_submodule(mname)
            module.register_parameter(pname, model.get_parameter(name))


# -- FSDP2 -----------------------------------------------------------------------------
def _layer_modules(model: nn.Module, layout: Layout) -> list[str]:
    """Decoder layers (``model.layers.<i>``) named by the layout, in layer order."""
    layers = sorted({i for t in layout.tensors if (i := layer_of(t.name)) is not None})
    return [f"model.layers.{i}" for i in layers]


def _shard_placement_fn(
    model: nn.Module, layout: Layout, mesh: Mesh
) -> Callable[[nn.Parameter], TShard]:
    i = mesh.axis_index(DP_SHARD)
    dims: dict[int, int] = {}
    params = dict(model.named_parameters())
    for t in layout.tensors:
        p = t.sharding.placements[i]
        if not isinstance(p, (Shard, StridedShard)):
            raise LayoutError(
                f"{t.name}: placement {p} on {DP_SHARD!r}; FSDP2 shards every parameter, use "
                "Shard(dim) (or StridedShard over a TP-sharded dim)"
            )
        dims[id(params[t.name])] = p.dim

    def fn(param: nn.Parameter) -> TShard:
        return TShard(dims[id(param)])

    return fn


def _enable_activation_checkpointing(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise LayoutError(
            f"activation_checkpointing needs a transformers PreTrainedModel, got "
            f"{type(model).__name__}; checkpoint its layers yourself or turn the option off"
        )
    if "activation_checkpointing_enable" in vars(PreTrainedModel):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:  # transformers releases before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@beartype
def apply_fsdp2(
    model: nn.Module,
    layout: Layout,
    device_mesh: DeviceMesh,
    *,
    options: Fsdp2RunOptions = Fsdp2RunOptions(),
    check: bool = True,
) -> nn.Module:
    """Tensor-parallelise then ``fully_shard`` ``model`` (in place) as ``layout`` says.

    ``device_mesh`` is :func:`init_mesh` of the layout's mesh. Every rank must call this
    with the same model (same initial weights if you rely on them; or load afterwards
    with :func:`load_canonical`). With ``check``, every parameter is compared with the
    layout afterwards (:func:`check_applied`) and a difference raises
    :class:`FSDP2MismatchError`.
    """
    mesh = _layout_mesh(layout)
    _check_device_mesh(mesh, device_mesh)
    names = param_names(model)
    plan = tp_plan(model, layout)
    if plan:
        parallelize_module(model, device_mesh[TP], plan)
        retie(model, names)
    if options.activation_checkpointing:
        _enable_activation_checkpointing(model)
    dp_names = tuple(n for n in (DP_REPLICATE, DP_SHARD) if n in mesh.names)
    dp_mesh = device_mesh[dp_names] if len(dp_names) > 1 else device_mesh[DP_SHARD]
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": options.reshard_after_forward,
        "shard_placement_fn": _shard_placement_fn(model, layout, mesh),
        "mp_policy": options.mixed_precision(),
        "offload_policy": options.offload(),
    }
    for name in _layer_modules(model, layout):
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    if check:
        problems = check_applied(model, layout, dist.get_rank())
        if problems:
            raise FSDP2MismatchError(
                f"FSDP2 built {len(problems)} parameter(s) unlike the layout:\n  "
                + "\n  ".join(problems[:20])
            )
    return model


@beartype
def check_applied(model: nn.Module, layout: Layout, rank: int) -> list[str]:
    """Differences between ``model``'s DTensor parameters and ``layout`` on ``rank`` (empty = none).

    Compares the parameter set, each parameter's mesh (axis names, sizes, rank grid),
    placements and local shape.
    """
    problems = []
    params = dict(model.named_parameters())
    want = {t.name for t in layout.tensors}
    for name in sorted(set(params) ^ want):
        where = "model" if name in params else "layout"
        problems.append(f"{name}: only in the {where}")
    locals_ = {lt.name: lt for lt in layout.local_tensors(rank)}
    for t in layout.tensors:
        param = params.get(t.name)
        if param is None:
            continue
        problems.extend(_param_problems(t, param, locals_.get(t.name)))
    return problems


def _param_problems(t: LogicalTensor, param: nn.Parameter, local: LocalTensor | None) -> list[str]:
    if not isinstance(param, DTensor):
        return [f"{t.name}: a plain {type(param).__name__}, not a DTensor"]
    out = []
    mesh = t.sharding.mesh
    dm = param.device_mesh
    names = tuple(dm.mesh_dim_names or ())
    grid = dm.mesh.flatten().tolist()
    if names != mesh.names or tuple(dm.shape) != mesh.sizes or grid != list(range(mesh.size)):
        out.append(f"{t.name}: mesh {names}={tuple(dm.shape)} ranks {grid}, layout {mesh}")
    want = torch_placements(t.sharding.placements)
    if tuple(param.placements) != want:
        out.append(f"{t.name}: placements {tuple(param.placements)}, layout {want}")
    if tuple(param.shape) != t.shape:
        out.append(f"{t.name}: global shape {tuple(param.shape)}, layout {t.shape}")
    lshape = tuple(param.to_local().shape)
    if local is None or lshape != local.shape:
        out.append(
            f"{t.name}: local shape {lshape}, layout {None if local is None else local.shape}"
        )
    return out


# -- data ------------------------------------------------------------------------------
def _canonical_source(canonical: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return canonical[name]
    except KeyError:
        raise ConversionError(
            f"canonical tensor {name!r} is missing; pass every canonical tensor of the model "
            "(hf_state_to_canonical(model.state_dict(), spec) gives them)"
        ) from None


def materialize_local(
    local: LocalTensor,
    canonical: Mapping[str, torch.Tensor],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``local`` filled from canonical tensors by its pieces (padding pieces zero).

    Writes into ``out`` (which must have ``local.shape``) when given, else a new tensor
    of the canonical dtype.
    """
    if out is None:
        first = next((p.canonical for p in local.pieces if p.canonical is not None), None)
        dtype = _canonical_source(canonical, first).dtype if first else getattr(torch, local.dtype)
        out = torch.zeros(local.shape, dtype=dtype)
    elif tuple(out.shape) != local.shape:
        raise ConversionError(
            f"{local.name}: the target holds shape {tuple(out.shape)}, the layout says "
            f"{local.shape}; the model and the layout disagree"
        )
    for piece in local.pieces:
        region = out[piece.local_box.slices()]
        if piece.canonical is None or piece.canonical_box is None:
            region.zero_()
            continue
        src = _canonical_source(canonical, piece.canonical)
        region.copy_(src[piece.canonical_box.slices()].reshape(piece.local_box.shape))
    return out


@beartype
def load_canonical(
    model: nn.Module, layout: Layout, rank: int, canonical: Mapping[str, torch.Tensor]
) -> None:
    """Write ``rank``'s pieces of the canonical tensors into its local parameter shards.

    ``canonical`` holds full canonical tensors (checkpoint names and shapes); each rank
    copies only its pieces (cast to the parameter dtype). No communication.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for local in layout.local_tensors(rank):
            param = params.get(local.name)
            if param is None:
                raise ConversionError(
                    f"layout tensor {local.name!r} is not a parameter of the model; apply the "
                    "same layout with apply_fsdp2 first"
                )
            target = param.to_local() if isinstance(param, DTensor) else param
            materialize_local(local, canonical, out=target)


@beartype
def export_canonical(
    model: nn.Module,
    layout: Layout,
    *,
    group: dist.ProcessGroup | None = None,
    check_replicas: bool = True,
) -> dict[str, torch.Tensor]:
    """Every canonical tensor, gathered from all ranks' local shards by the layout's pieces.

    Collective over ``group`` (default: the world, which the layout must cover): one
    all-gather per layout tensor, then each rank's pieces are written back into
    canonical tensors (CPU). Bitwise exact; with ``check_replicas`` replicas that
    disagree raise, and a canonical tensor not covered exactly raises.
    """
    world = dist.get_world_size(group)
    if world != layout.world_size:
        raise LayoutError(
            f"the {layout.kind} layout spans {layout.world_size} ranks, the group {world}"
        )
    params = dict(model.named_parameters())
    specs = {c.name: c for c in layout.canonical}
    out: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    locals_by_rank = [{lt.name: lt for lt in layout.local_tensors(r)} for r in range(world)]
    for t in layout.tensors:
        param = params.get(t.name)
        if param is None:
            raise ConversionError(f"layout tensor {t.name!r} is not a parameter of the model")
        mine = param.to_local() if isinstance(param, DTensor) else param
        mine = mine.detach().contiguous().reshape(-1)
        sizes = [lt[t.name].numel if t.name in lt else 0 for lt in locals_by_rank]
        pad = max(sizes)
        buf = torch.zeros(pad, dtype=mine.dtype, device=mine.device)
        buf[: mine.numel()] = mine
        gathered = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(gathered, buf, group=group)
        for r in range(world):
            local = locals_by_rank[r].get(t.name)
            if local is None:
                continue
            data = gathered[r][: sizes[r]].reshape(local.shape).cpu()
            for piece in local.pieces:
                if piece.canonical is None or piece.canonical_box is None:
                    continue
                if piece.canonical not in out:
                    spec = specs[piece.canonical]
                    out[piece.canonical] = torch.empty(spec.shape, dtype=data.dtype)
                    written[piece.canonical] = torch.zeros(spec.shape, dtype=torch.bool)
                dst = out[piece.canonical][piece.canonical_box.slices()]
                seen = written[piece.canonical][piece.canonical_box.slices()]
                src = data[piece.local_box.slices()].reshape(piece.canonical_box.shape)
                if check_replicas and bool(seen.any()):
                    if not torch.equal(_bits(dst[seen]), _bits(src[seen])):
                        raise FSDP2MismatchError(
                            f"{piece.canonical} {piece.canonical_box}: rank {r}'s replica differs "
                            "from an earlier rank's; the replicas are out of sync"
                        )
                dst.copy_(src)
                seen.fill_(True)
    for c in layout.canonical:
        if c.name not in written or not bool(written[c.name].all()):
            held = 0 if c.name not in written else int(written[c.name].sum())
            raise ConversionError(
                f"the layout covers {held} of {math.prod(c.shape)} elements of {c.name!r}; "
                "every canonical element must lie in some rank's pieces"
            )
    return {c.name: out[c.name] for c in layout.canonical}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t
