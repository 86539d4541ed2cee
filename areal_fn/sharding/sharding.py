"""`Sharding` (a mesh plus one placement per axis) and the geometry it implies.

Semantics are DTensor's, exactly: placements are applied left to right over the mesh
axes; ``Shard`` chunks the current local extent of a dim like ``torch.chunk`` (the
last chunks may be short or empty); ``StridedShard(dim, k)`` first cuts the current
extent into ``k`` ``torch.chunk`` blocks, chunks every block over the axis and gives
rank ``i`` every block's ``i``-th chunk, concatenated; ``Replicate`` and ``Partial``
leave the geometry unchanged. Along one dim a rank therefore holds an ordered list of
global index segments; a rank's local tensor is the product of its dims' segments.
"""

import itertools
import math
from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import (
    PLACEMENT_TYPES,
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
)
from areal_fn.typecheck import beartype

Segments = tuple[tuple[int, int], ...]


def _placements(value: object) -> tuple[Placement, ...]:
    if isinstance(value, PLACEMENT_TYPES):
        return (value,)  # type: ignore[return-value]
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise SpecError(
            f"Sharding.placements={value!r} must be a sequence with one placement per mesh axis"
        )
    out = tuple(value)
    for i, p in enumerate(out):
        if not isinstance(p, PLACEMENT_TYPES):
            raise SpecError(
                f"Sharding.placements[{i}]={p!r} is not a placement; use Replicate(), Shard(dim=d), "
                "StridedShard(dim=d, split_factor=k) or Partial(op='sum')"
            )
    return out


def _check_mesh(_inst: object, _attr: object, value: Mesh) -> None:
    if not isinstance(value, Mesh):
        raise SpecError(f"Sharding.mesh={value!r} must be a Mesh")


@attrs.frozen(kw_only=True)
class Sharding:
    """One placement per mesh axis: ``Sharding(mesh=Mesh.of(dp=2, tp=2), placements=(Shard(dim=0), Replicate()))``."""

    mesh: Mesh = attrs.field(validator=_check_mesh)
    placements: tuple[Placement, ...] = attrs.field(converter=_placements)

    def __attrs_post_init__(self) -> None:
        if len(self.placements) != self.mesh.ndim:
            raise SpecError(
                f"Sharding has {len(self.placements)} placements {self.placements_str} for a mesh with "
                f"{self.mesh.ndim} axes {self.mesh.names!r}; give exactly one placement per mesh axis"
            )

    @classmethod
    def replicated(cls, mesh: Mesh) -> "Sharding":
        return cls(mesh=mesh, placements=tuple(Replicate() for _ in mesh.names))

    @property
    def placements_str(self) -> str:
        return "(" + ", ".join(str(p) for p in self.placements) + ")"

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each element (product of Replicate/Partial axis sizes)."""
        return math.prod(
            s
            for p, s in zip(self.placements, self.mesh.sizes, strict=True)
            if isinstance(p, (Replicate, Partial))
        )

    def axes_sharding(self, dim: int) -> tuple[int, ...]:
        """Mesh axis indices whose placement shards tensor dim ``dim``, in mesh order."""
        return tuple(
            i
            for i, p in enumerate(self.placements)
            if isinstance(p, (Shard, StridedShard)) and p.dim == dim
        )

    def __str__(self) -> str:
        return " ".join(f"{n}:{p}" for n, p in zip(self.mesh.names, self.placements, strict=True))


def check_sharding(shape: tuple[int, ...], sharding: Sharding) -> None:
    """Raise ``SpecError`` if ``sharding`` cannot apply to a tensor of ``shape``."""
    if not isinstance(sharding, Sharding):
        raise SpecError(f"sharding={sharding!r} must be a Sharding")
    for axis, p in zip(sharding.mesh.names, sharding.placements, strict=True):
        if isinstance(p, (Shard, StridedShard)) and p.dim >= len(shape):
            raise SpecError(
                f"{p!r} on mesh axis {axis!r} shards dim {p.dim}, but the tensor has shape {shape} "
                f"({len(shape)} dims); use a dim in 0..{len(shape) - 1} or Replicate()"
            )


# -- one-dimensional geometry ---------------------------------------------------------
def _select(segs: Segments, lo: int, hi: int) -> Segments:
    """Positions ``[lo, hi)`` of the index sequence ``segs`` (itself a segment list)."""
    out = []
    pos = 0
    for a, b in segs:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
        if pos >= hi:
            break
    return tuple(out)


def _chunk(length: int, n: int, i: int) -> tuple[int, int]:
    """``torch.chunk(range(length), n)[i]`` as positions (empty past the last chunk)."""
    size = -(-length // n) if length else 0
    return min(i * size, length), min((i + 1) * size, length)


def dim_segments(length: int, steps: Sequence[tuple[Placement, int, int]]) -> Segments:
    """Global index segments one rank holds along a dim of ``length``.

    ``steps``: the shard-like placements on this dim in mesh order, each with its axis
    size and this rank's coordinate on that axis.
    """
    segs: Segments = ((0, length),) if length else ()
    for p, n, c in steps:
        cur = sum(b - a for a, b in segs)
        if isinstance(p, StridedShard):
            parts: list[tuple[int, int]] = []
            for j in range(p.split_factor):
                blo, bhi = _chunk(cur, p.split_factor, j)
                clo, chi = _chunk(bhi - blo, n, c)
                parts.extend(_select(segs, blo + clo, blo + chi))
            segs = _merge(parts)
        else:
            lo, hi = _chunk(cur, n, c)
            segs = _select(segs, lo, hi)
    return segs


def _merge(segs: Sequence[tuple[int, int]]) -> Segments:
    out: list[tuple[int, int]] = []
    for a, b in segs:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _rank_segments(shape: tuple[int, ...], sharding: Sharding, rank: int) -> tuple[Segments, ...]:
    check_sharding(shape, sharding)
    coords = sharding.mesh.coords(rank)
    per_dim: list[list[tuple[Placement, int, int]]] = [[] for _ in shape]
    for p, n, c in zip(sharding.placements, sharding.mesh.sizes, coords, strict=True):
        if isinstance(p, (Shard, StridedShard)):
            per_dim[p.dim].append((p, n, c))
    return tuple(dim_segments(length, steps) for length, steps in zip(shape, per_dim, strict=True))


# -- public geometry -----------------------------------------------------------------
@beartype
def local_shape(shape: tuple[int, ...], sharding: Sharding, rank: int) -> tuple[int, ...]:
    """Shape of ``rank``'s local tensor (what ``DTensor.to_local().shape`` is)."""
    return tuple(sum(b - a for a, b in segs) for segs in _rank_segments(shape, sharding, rank))


@beartype
def local_pieces(
    shape: tuple[int, ...], sharding: Sharding, rank: int
) -> tuple[tuple[Box, Box], ...]:
    """``(global box, local box)`` pairs of ``rank``, in local row-major order.

    Empty when the local tensor is empty. A 0-d tensor has one piece of 0 dims.
    """
    per_dim = _rank_segments(shape, sharding, rank)
    with_local = []
    for segs in per_dim:
        pos, row = 0, []
        for a, b in segs:
            row.append(((a, b), (pos, pos + b - a)))
            pos += b - a
        with_local.append(row)
    out = []
    for combo in itertools.product(*with_local):
        out.append(
            (Box._trusted(tuple(g for g, _ in combo)), Box._trusted(tuple(loc for _, loc in combo)))
        )
    return tuple(out)


@beartype
def local_boxes(shape: tuple[int, ...], sharding: Sharding, rank: int) -> tuple[Box, ...]:
    """Global boxes ``rank`` holds, in local order (a ``StridedShard`` yields several)."""
    return tuple(g for g, _ in local_pieces(shape, sharding, rank))
