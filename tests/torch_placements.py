"""Our placements as real DTensor placement objects (shared by the oracles and dist workers)."""

import itertools
import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Placement as TPlacement
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard

from areal_fn.runtime.engines.fsdp2_apply import torch_placement, torch_placements
from areal_fn.sharding.placement import Partial, Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding, dim_segments


def to_torch(p: Placement) -> TPlacement:
    """The DTensor placement equal to ``p`` (the runtime's own conversion)."""
    return torch_placement(p)


def to_torch_all(placements: Sequence[Placement]) -> tuple[TPlacement, ...]:
    return torch_placements(placements)


def from_torch(p: object) -> Placement:
    """Our placement equal to the DTensor placement ``p`` (for recording real layouts)."""
    if isinstance(p, _StridedShard):
        return StridedShard(dim=p.dim, split_factor=int(p.split_factor))
    if isinstance(p, TShard):
        return Shard(dim=p.dim)
    if isinstance(p, TReplicate):
        return Replicate()
    if isinstance(p, TPartial):
        return Partial(op=p.reduce_op)
    raise TypeError(f"unknown DTensor placement: {p!r}")


def from_torch_all(placements: Sequence[object]) -> tuple[Placement, ...]:
    return tuple(from_torch(p) for p in placements)


def gather_safe(s: Sharding) -> Sharding:
    """The FSDP2-shaped variant of ``s``: a sharding DTensor's ``full_tensor`` inverts.

    Per tensor dim, only the first shard-like axis may be a ``StridedShard``, and its
    ``split_factor`` is the product of the sizes of the later axes sharding that dim
    (which become plain ``Shard``): exactly what ``fully_shard`` builds over TP. DTensor
    (torch 2.13) splits every sharding as we do, but its redistribution does not invert
    that split for a ``_StridedShard`` that follows another shard of the same dim, nor
    for one whose split factor differs from that product.
    """
    out = list(s.placements)
    for i, p in enumerate(s.placements):
        if not isinstance(p, (Shard, StridedShard)):
            continue
        axes = s.axes_sharding(p.dim)
        if any(j < i for j in axes):
            out[i] = Shard(dim=p.dim)
        elif isinstance(p, StridedShard):
            k = math.prod(s.mesh.sizes[j] for j in axes if j > i)
            out[i] = StridedShard(dim=p.dim, split_factor=k)
    return Sharding(mesh=s.mesh, placements=tuple(out))


def is_gather_safe(s: Sharding) -> bool:
    return gather_safe(s) == s


def split_is_nested(shape: tuple[int, ...], s: Sharding) -> bool:
    """Whether DTensor's split of ``s`` equals FSDP2's nested chunking (``s`` gather-safe).

    For ``(StridedShard(d, k), Shard(d), ...)`` DTensor splits like us (chunk the
    concatenation of every block's chunk), but its ``full_tensor`` inverts the layout
    FSDP2 stores: the later axes chunk dim ``d`` first and the strided axis then chunks
    each local block (nested ``torch.chunk``). The two agree unless sizes are uneven
    in a particular way (length 9 over dp=4 x tp=2 is the smallest); where they
    differ, DTensor's gather fails or misplaces data on ``distribute_tensor``'s output.
    """
    mesh = s.mesh
    for i, p in enumerate(s.placements):
        if not isinstance(p, StridedShard):
            continue
        later = [j for j in s.axes_sharding(p.dim) if j > i]
        length = shape[p.dim]
        for c in itertools.product(*(range(mesh.sizes[j]) for j in [i, *later])):
            ci, rest = c[0], c[1:]
            split = [(p, mesh.sizes[i], ci)] + [
                (s.placements[j], mesh.sizes[j], cj) for j, cj in zip(later, rest, strict=True)
            ]
            nested = [
                (s.placements[j], mesh.sizes[j], cj) for j, cj in zip(later, rest, strict=True)
            ] + [(Shard(dim=p.dim), mesh.sizes[i], ci)]
            if dim_segments(length, split) != dim_segments(length, nested):
                return False
    return True
