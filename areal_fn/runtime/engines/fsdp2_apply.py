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

This module performs the FSDP2 step and re-exports the rest, each in a module of its
own: the mesh and placements (:mod:`~areal_fn.runtime.engines.fsdp2_mesh`), the TP
plan (:mod:`~areal_fn.runtime.engines.tp_styles`) and the data moves
(:mod:`~areal_fn.runtime.engines.fsdp2_data`).
"""

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import parallelize_module

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.layout import Layout, LocalTensor, LogicalTensor
from areal_fn.model.spec import layer_of
from areal_fn.runtime.engines.fp8_training import FLOAT8_RECIPES, convert_to_float8
from areal_fn.runtime.engines.fsdp2_data import export_canonical as export_canonical
from areal_fn.runtime.engines.fsdp2_data import layout_tensors as layout_tensors
from areal_fn.runtime.engines.fsdp2_data import load_canonical as load_canonical
from areal_fn.runtime.engines.fsdp2_data import materialize_local as materialize_local
from areal_fn.runtime.engines.fsdp2_mesh import DP_REPLICATE as DP_REPLICATE
from areal_fn.runtime.engines.fsdp2_mesh import DP_SHARD as DP_SHARD
from areal_fn.runtime.engines.fsdp2_mesh import TP as TP
from areal_fn.runtime.engines.fsdp2_mesh import FSDP2MismatchError as FSDP2MismatchError
from areal_fn.runtime.engines.fsdp2_mesh import check_device_mesh, layout_mesh
from areal_fn.runtime.engines.fsdp2_mesh import init_groups as init_groups
from areal_fn.runtime.engines.fsdp2_mesh import init_mesh as init_mesh
from areal_fn.runtime.engines.fsdp2_mesh import torch_placement as torch_placement
from areal_fn.runtime.engines.fsdp2_mesh import torch_placements as torch_placements
from areal_fn.runtime.engines.tp_styles import ReplicateParallel as ReplicateParallel
from areal_fn.runtime.engines.tp_styles import module_placements as module_placements
from areal_fn.runtime.engines.tp_styles import param_names as param_names
from areal_fn.runtime.engines.tp_styles import retie as retie
from areal_fn.runtime.engines.tp_styles import tensor_parallel_style as tensor_parallel_style
from areal_fn.runtime.engines.tp_styles import tp_plan as tp_plan
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Shard, StridedShard
from areal_fn.sharding.sharding import Sharding
from areal_fn.typecheck import beartype

__all__ = [
    "FSDP2MismatchError",
    "Fsdp2RunOptions",
    "ReplicateParallel",
    "apply_fsdp2",
    "check_applied",
    "export_canonical",
    "init_groups",
    "init_mesh",
    "load_canonical",
    "materialize_local",
    "torch_placement",
    "torch_placements",
    "tp_plan",
]

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _dtype_or_none(_inst: object, attr: "attrs.Attribute[str | None]", value: str | None) -> None:
    if value is not None and value not in _DTYPES:
        raise SpecError(f"Fsdp2RunOptions.{attr.name}={value!r} is not one of {_DTYPES} or None")


def _float8_recipe(_inst: object, _attr: object, value: str | None) -> None:
    if value is not None and value not in FLOAT8_RECIPES:
        raise SpecError(
            f"Fsdp2RunOptions.float8_recipe={value!r} is not one of torchao's recipes "
            f"{FLOAT8_RECIPES} or None"
        )


@attrs.frozen(kw_only=True)
class Fsdp2RunOptions:
    """How the runtime applies FSDP2 (choices that do not change the layout).

    ``param_dtype``/``reduce_dtype``: FSDP2 mixed precision (``None`` keeps the
    parameters' dtype). ``cpu_offload``: keep sharded parameters, gradients and
    optimizer state on the CPU (``CPUOffloadPolicy``; on a CPU mesh the data is
    already there). ``activation_checkpointing``: recompute each decoder layer in
    backward (transformers' activation checkpointing, non-reentrant). ``reshard_after_forward``: free unsharded parameters after forward.
    ``float8_recipe``: torchao's float8 training of the linear layers
    (:mod:`~areal_fn.runtime.engines.fp8_training`; ``None``: off).
    """

    param_dtype: str | None = attrs.field(default=None, validator=_dtype_or_none)
    reduce_dtype: str | None = attrs.field(default=None, validator=_dtype_or_none)
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    float8_recipe: str | None = attrs.field(default=None, validator=_float8_recipe)

    def mixed_precision(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=getattr(torch, self.param_dtype) if self.param_dtype else None,
            reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype else None,
        )

    def offload(self) -> OffloadPolicy:
        return CPUOffloadPolicy(pin_memory=False) if self.cpu_offload else OffloadPolicy()


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
        if t.name not in params:
            continue  # a buffer: FSDP2 leaves it whole (the layout replicates it)
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
        model.activation_checkpointing_enable(  # type: ignore[operator]  # (transformers < 5.20 has no such method)
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
    mesh = layout_mesh(layout)
    check_device_mesh(mesh, device_mesh)
    if options.float8_recipe is not None:  # before TP and FSDP2 wrap the linear layers
        convert_to_float8(model, options.float8_recipe)
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
    params = layout_tensors(model)
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


def _param_problems(t: LogicalTensor, param: torch.Tensor, local: LocalTensor | None) -> list[str]:
    if not isinstance(param, nn.Parameter) and not isinstance(param, DTensor):
        # a buffer: whole on every rank, as the layout's replicated sharding says
        if t.sharding != Sharding.replicated(t.sharding.mesh):
            return [f"{t.name}: a buffer (whole on every rank), layout {t.sharding}"]
        if tuple(param.shape) != t.shape:
            return [f"{t.name}: buffer shape {tuple(param.shape)}, layout {t.shape}"]
        return []
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
