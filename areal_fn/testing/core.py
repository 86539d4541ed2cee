"""Hypothesis strategies for meshes, placements, shardings, shapes and tensors."""

import math

import torch
from hypothesis import strategies as st

from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Partial, Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding

AXIS_NAMES = ("dp", "tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "etp")

#: dtypes drawn by :func:`tensors` (bf16 included).
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)


@st.composite
def meshes(
    draw: st.DrawFn,
    *,
    min_axes: int = 1,
    max_axes: int = 4,
    max_world: int = 64,
    max_axis_size: int = 8,
) -> Mesh:
    """Meshes of 1..4 named axes whose world size is at most ``max_world``."""
    n = draw(st.integers(min_axes, max_axes))
    names = draw(st.permutations(AXIS_NAMES))[:n]
    sizes = []
    budget = max_world
    for _ in range(n):
        s = draw(st.integers(1, max(1, min(max_axis_size, budget))))
        sizes.append(s)
        budget //= s
    return Mesh(names=tuple(names), sizes=tuple(sizes))


@st.composite
def shapes(
    draw: st.DrawFn, *, min_dims: int = 1, max_dims: int = 3, max_side: int = 13
) -> tuple[int, ...]:
    """Small shapes; sides include 0, 1 and sizes that do not divide evenly."""
    n = draw(st.integers(min_dims, max_dims))
    return tuple(draw(st.integers(0, max_side)) for _ in range(n))


@st.composite
def placements(
    draw: st.DrawFn,
    ndim: int,
    *,
    allow_strided: bool = True,
    partial_ops: tuple[str, ...] = ("sum", "avg", "max", "min"),
    max_split_factor: int = 4,
) -> Placement:
    """One placement valid for an ``ndim``-dim tensor."""
    kinds = ["R"]
    if ndim > 0:
        kinds.append("S")
        if allow_strided:
            kinds.append("SS")
    if partial_ops:
        kinds.append("P")
    kind = draw(st.sampled_from(kinds))
    if kind == "R":
        return Replicate()
    if kind == "P":
        return Partial(op=draw(st.sampled_from(partial_ops)))
    dim = draw(st.integers(0, ndim - 1))
    if kind == "S":
        return Shard(dim=dim)
    return StridedShard(dim=dim, split_factor=draw(st.integers(1, max_split_factor)))


@st.composite
def shardings(
    draw: st.DrawFn,
    ndim: int,
    *,
    mesh: Mesh | None = None,
    allow_strided: bool = True,
    partial_ops: tuple[str, ...] = ("sum", "max", "min"),
    max_world: int = 64,
) -> Sharding:
    """A sharding valid for any tensor with ``ndim`` dims (on ``mesh`` or a drawn one).

    Mixed Partial ops on one sharding are never drawn (they have no defined order).
    """
    m = mesh if mesh is not None else draw(meshes(max_world=max_world))
    op = draw(st.sampled_from(partial_ops)) if partial_ops else None
    ps = tuple(
        draw(placements(ndim, allow_strided=allow_strided, partial_ops=(op,) if op else ()))
        for _ in m.names
    )
    return Sharding(mesh=m, placements=ps)


@st.composite
def sharded_shapes(draw: st.DrawFn, **kwargs: object) -> tuple[tuple[int, ...], Sharding]:
    """A shape and a sharding valid for it."""
    shape = draw(shapes())
    return shape, draw(shardings(len(shape), **kwargs))  # type: ignore[arg-type]


@st.composite
def tensors(
    draw: st.DrawFn,
    shape: tuple[int, ...],
    *,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    finite: bool = False,
) -> torch.Tensor:
    """A tensor of ``shape`` with arbitrary bits (NaN, inf and -0.0 included for floats).

    ``finite=True`` replaces NaN and inf by 0 (for laws about arithmetic reductions).
    """
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool().reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape)
    if finite and dtype.is_floating_point:
        t = torch.where(torch.isfinite(t), t, torch.zeros((), dtype=dtype))
    return t
