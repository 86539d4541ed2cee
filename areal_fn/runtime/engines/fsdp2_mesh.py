"""An FSDP2 layout's mesh in DTensor terms: axis names, the ``DeviceMesh``, placements.

:func:`init_mesh` builds the ``DeviceMesh`` with the layout mesh's axis names and sizes
(``dp_replicate`` when HSDP, ``dp_shard``, ``tp`` when > 1), row-major like our
:class:`~areal_fn.sharding.mesh.Mesh`; :func:`torch_placement` is our placement as
DTensor's. Re-exported by :mod:`areal_fn.runtime.engines.fsdp2_apply`.
"""

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Placement as TPlacement
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import Layout
from areal_fn.sharding.mesh import Axis, Mesh
from areal_fn.sharding.placement import Partial, Placement, Replicate, Shard, StridedShard
from areal_fn.typecheck import beartype

__all__ = [
    "AXES",
    "DP_REPLICATE",
    "DP_SHARD",
    "TP",
    "FSDP2MismatchError",
    "check_device_mesh",
    "init_groups",
    "init_mesh",
    "layout_mesh",
    "torch_placement",
    "torch_placements",
]

#: Axis names of an FSDP2 layout mesh (see :func:`~areal_fn.layouts.fsdp2.fsdp2_mesh`).
DP_REPLICATE, DP_SHARD, TP = Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP
AXES = (DP_REPLICATE, DP_SHARD, TP)


class FSDP2MismatchError(RuntimeError):
    """The module FSDP2 built does not hold what the layout says (mesh, placement, shape)."""


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


def init_groups(groups: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup | None:
    """A process group for every rank group (collective: every rank calls it with the same
    groups); returns the one holding ``rank``, ``None`` when the groups are single ranks."""
    if all(len(g) == 1 for g in groups):
        return None
    mine = None
    for g in groups:
        pg = dist.new_group(list(g))
        if rank in g:
            mine = pg
    if mine is None:
        raise LayoutError(f"rank {rank} is in none of the groups {[tuple(g) for g in groups]}")
    return mine


def layout_mesh(layout: Layout) -> Mesh:
    """The one mesh of an FSDP2 layout; ``LayoutError`` for any other layout."""
    meshes = layout.meshes
    if len(meshes) != 1:
        raise LayoutError(
            f"an FSDP2 layout has one mesh, this {layout.kind} layout has {len(meshes)}: "
            f"{[str(m) for m in meshes]}; build it with fsdp2_layout"
        )
    mesh = meshes[0]
    unknown = [n for n in mesh.names if n not in AXES]
    if unknown or DP_SHARD not in mesh.names:
        raise LayoutError(
            f"{mesh} is not an FSDP2 mesh: axes must be drawn from {AXES} and include "
            f"{DP_SHARD!r}; build the layout with fsdp2_layout"
        )
    return mesh


def check_device_mesh(mesh: Mesh, device_mesh: DeviceMesh) -> None:
    """Raise ``LayoutError`` unless ``device_mesh`` has ``mesh``'s axis names and sizes."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if names != mesh.names or tuple(device_mesh.shape) != mesh.sizes:
        raise LayoutError(
            f"device mesh {names}={tuple(device_mesh.shape)} is not the layout's {mesh}; "
            "build it with init_mesh(layout.meshes[0])"
        )
