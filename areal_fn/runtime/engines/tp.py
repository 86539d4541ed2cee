"""A stand-in inference engine: a transformers model under DTensor tensor parallelism.

SGLang and vLLM shard HF weights by the rules of
:func:`~areal_fn.layouts.inference.inference_layout`. A plain transformers model
parallelised with ``parallelize_module`` over a 1-D ``tp`` mesh holds the same local
tensors (without the engines' vocabulary padding: build the layout with
``vocab_multiple=1``), which makes it a CPU-runnable destination for weight sync::

    layout = inference_layout(spec, ParallelDims(tp=2), vocab_multiple=1)   # pure
    tp_mesh = DeviceMesh("cpu", [2, 3], mesh_dim_names=("tp",))              # every rank
    model = apply_tp(model, layout, tp_mesh)                                  # ranks 2, 3
    weights = local_tensors(model)      # name -> local shard, what sync writes into

Styles by the layout's ``tp`` placement: ``Linear`` ``Shard(0)`` column-wise (the
output stays sharded inside decoder layers, ``lm_head`` gathers it), ``Linear``
``Shard(1)`` row-wise, ``Embedding`` ``Shard(0)`` row-wise over the vocabulary;
modules whose parameters are all ``Replicate()`` are left as they are (plain tensors,
identical on every rank). One replica, no pipeline stages, no replicated KV heads
(``tp > num_key_value_heads``): the stand-in refuses layouts it cannot hold.
"""

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    parallelize_module,
)

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import Layout, LogicalTensor
from areal_fn.runtime.engines.fsdp2_apply import (
    module_placements,
    param_names,
    retie,
    tensor_parallel_style,
)
from areal_fn.sharding.mesh import Axis
from areal_fn.sharding.placement import Placement, Replicate
from areal_fn.typecheck import beartype

__all__ = ["apply_tp", "check_applied", "layout_rank", "local_tensors", "tp_plan"]

TP = Axis.TP


def _tp_placement(t: LogicalTensor) -> Placement:
    mesh = t.sharding.mesh
    for name, size in zip(mesh.names, mesh.sizes, strict=True):
        if name not in (Axis.DP, Axis.PP, Axis.TP, Axis.TP_KV, Axis.TP_REP):
            raise LayoutError(
                f"{t.name}: mesh axis {name!r} of {mesh} is not an inference axis; build the "
                "layout with inference_layout"
            )
        if name in (Axis.DP, Axis.PP) and size != 1:
            raise LayoutError(
                f"{t.name}: the TP stand-in engine holds one replica of one stage, the layout has "
                f"{name}={size}; build it with ParallelDims(tp=...) only"
            )
        if name == Axis.TP_REP and size != 1:
            raise LayoutError(
                f"{t.name}: the layout replicates each KV head on tp_rep={size} ranks "
                "(tp > num_key_value_heads), which column-wise DTensor TP cannot hold; use "
                "tp <= num_key_value_heads"
            )
    axis = TP if TP in mesh.names else Axis.TP_KV
    return t.sharding.placements[mesh.axis_index(axis)]


def _style(
    mname: str, module: nn.Module, placements: Mapping[str, Placement]
) -> ParallelStyle | None:
    if all(isinstance(p, Replicate) for p in placements.values()):
        return None  # plain tensors, identical on every rank
    return tensor_parallel_style(mname, module, placements)


@beartype
def tp_plan(model: nn.Module, layout: Layout) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) of an inference ``layout``.

    A tied parameter (``lm_head`` of a tied model) takes the placement of the tensor it
    is tied to. Raises :class:`~areal_fn.errors.LayoutError` when a model parameter is
    not in the layout (e.g. a MoE model, whose stacked experts are not canonical names).
    """
    grouped = module_placements(
        model,
        {t.name: _tp_placement(t) for t in layout.tensors},
        kind=layout.kind,
        remedy="the stand-in engine needs parameter names equal to canonical names (dense models)",
    )
    plan: dict[str, ParallelStyle] = {}
    for mname, module in model.named_modules():
        if mname in grouped:
            style = _style(mname, module, grouped[mname])
            if style is not None:
                plan[mname] = style
    return plan


@beartype
def apply_tp(model: nn.Module, layout: Layout, tp_mesh: DeviceMesh) -> nn.Module:
    """Tensor-parallelise ``model`` in place over the 1-D ``tp_mesh`` as ``layout`` says.

    Call it on the ranks of ``tp_mesh`` (the mesh itself is created on every rank of the
    world). Tied parameters stay tied.
    """
    if tp_mesh.ndim != 1 or tp_mesh.size() != layout.world_size:
        raise LayoutError(
            f"the TP mesh has shape {tuple(tp_mesh.shape)}, the {layout.kind} layout spans "
            f"{layout.world_size} ranks; pass a 1-D mesh of exactly its ranks"
        )
    names = param_names(model)
    parallelize_module(model, tp_mesh, tp_plan(model, layout))
    retie(model, names)
    return model


@beartype
def layout_rank(tp_mesh: DeviceMesh) -> int:
    """This process's rank in the inference layout (its coordinate on the ``tp`` mesh)."""
    return tp_mesh.get_local_rank()


@beartype
def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's local tensor (a shard for DTensors), by ``named_parameters()`` name.

    The tensors share storage with the parameters: writing them (under ``no_grad``)
    updates the model.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p.to_local() if isinstance(p, DTensor) else p.data
    return out


@beartype
def check_applied(model: nn.Module, layout: Layout, rank: int) -> list[str]:
    """Differences between ``model``'s local tensors and ``layout`` on ``rank`` (empty = none).

    Compares the parameter names and each local shape and dtype.
    """
    problems: list[str] = []
    mine = local_tensors(model)
    want = {lt.name: lt for lt in layout.local_tensors(rank)}
    for name in sorted(set(mine) ^ set(want)):
        problems.append(f"{name}: only in the {'model' if name in mine else 'layout'}")
    for name, lt in want.items():
        t = mine.get(name)
        if t is None:
            continue
        if tuple(t.shape) != lt.shape:
            problems.append(f"{name}: local shape {tuple(t.shape)}, layout {lt.shape}")
        if str(t.dtype).removeprefix("torch.") != lt.dtype:
            problems.append(f"{name}: dtype {t.dtype}, layout {lt.dtype}")
    return problems
