"""`shard` / `unshard`: a full tensor <-> the local tensors of every rank.

Pure tensor arithmetic (no process groups): the runtime uses these to materialise
and check layouts; tests use them as the reference for DTensor.
"""

import itertools
from collections.abc import Mapping, Sequence

import torch
from jaxtyping import Shaped, jaxtyped
from torch import Tensor

from areal_fn.errors import SpecError
from areal_fn.sharding.placement import Partial, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding, check_sharding, local_pieces, local_shape
from areal_fn.typecheck import beartype


def _is_partial_root(sharding: Sharding, rank: int) -> bool:
    coords = sharding.mesh.coords(rank)
    return all(
        c == 0
        for p, c in zip(sharding.placements, coords, strict=True)
        if isinstance(p, Partial) and p.op == "sum"
    )


def _additive_identity(shape: tuple[int, ...], like: Tensor) -> Tensor:
    if like.dtype.is_floating_point or like.dtype.is_complex:
        # -0.0 is the exact additive identity: x + (-0.0) == x bitwise, for x = +0.0 too.
        return torch.full(shape, -0.0, dtype=like.dtype, device=like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


@jaxtyped(typechecker=beartype)
def shard(tensor: Shaped[Tensor, "..."], sharding: Sharding, rank: int) -> Shaped[Tensor, "..."]:
    """The local tensor ``rank`` holds under ``sharding`` (contiguous).

    A single-piece local tensor that is already contiguous shares storage with
    ``tensor`` (like ``torch.chunk``); clone it to own it. ``Partial(sum)`` axes give
    the full value to coordinate 0 and the exact additive identity (``-0.0``) to the
    others, so ``unshard`` restores the input bitwise; ``Partial(avg|max|min)`` give
    every rank the full value.
    """
    shape = tuple(tensor.shape)
    lshape = local_shape(shape, sharding, rank)
    if not _is_partial_root(sharding, rank):
        return _additive_identity(lshape, tensor)
    pieces = local_pieces(shape, sharding, rank)
    if len(pieces) == 1 and pieces[0][0].shape == lshape:
        return tensor[pieces[0][0].slices()].contiguous()
    out = torch.empty(lshape, dtype=tensor.dtype, device=tensor.device)
    for g, loc in pieces:
        out[loc.slices()] = tensor[g.slices()]
    return out


def _as_rank_list(
    locals_by_rank: "Sequence[Tensor] | Mapping[int, Tensor]", world: int
) -> list[Tensor]:
    if isinstance(locals_by_rank, Mapping):
        missing = [r for r in range(world) if r not in locals_by_rank]
        extra = sorted(r for r in locals_by_rank if not (isinstance(r, int) and 0 <= r < world))
        if missing or extra:
            raise SpecError(
                f"unshard needs exactly one local tensor per rank 0..{world - 1}; "
                f"missing ranks {missing}, unexpected keys {extra}"
            )
        return [locals_by_rank[r] for r in range(world)]
    if len(locals_by_rank) != world:
        raise SpecError(
            f"unshard got {len(locals_by_rank)} local tensors for a mesh of {world} ranks; pass one per rank"
        )
    return list(locals_by_rank)


def infer_global_shape(
    local_shapes: Sequence[tuple[int, ...]], sharding: Sharding
) -> tuple[int, ...]:
    """Global shape from every rank's local shape (sum along the axes sharding a dim)."""
    mesh = sharding.mesh
    ndim = len(local_shapes[0])
    out = []
    for d in range(ndim):
        axes = set(sharding.axes_sharding(d))
        total = 0
        for r in range(mesh.size):
            c = mesh.coords(r)
            if all(c[i] == 0 for i in range(mesh.ndim) if i not in axes):
                total += local_shapes[r][d]
        out.append(total)
    return tuple(out)


def as_bytes(t: Tensor) -> Tensor:
    """The raw bytes of ``t`` as a flat uint8 tensor (a copy when ``t`` is not dense).

    Bitwise comparison that NaN payloads, ``-0.0`` and zero-stride views cannot fool.
    """
    if t.dtype == torch.bool:
        return t.reshape(-1).to(torch.uint8)
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) if not _is_dense(t) else t
    return dense.reshape(-1).view(torch.uint8)


def _is_dense(t: Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if size != 1 and stride != expected:
            return False
        if size == 1 and stride != expected:
            return False
        expected *= size
    return True


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same shape, same dtype and the same bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def _reduce(values: list[Tensor], op: str, ranks: list[int]) -> Tensor:
    if len(values) == 1:
        return values[0]
    if op == "avg" and not values[0].dtype.is_floating_point:
        raise SpecError(
            f"Partial(op='avg') over ranks {ranks} holds dtype {values[0].dtype}; averaging needs a "
            "floating-point dtype; cast first or use Partial(op='sum')"
        )
    acc = values[0].clone()
    for v in values[1:]:
        if op in ("sum", "avg"):
            acc += v
        elif op == "max":
            torch.maximum(acc, v, out=acc)
        else:
            torch.minimum(acc, v, out=acc)
    if op == "avg":
        acc /= len(values)
    return acc


@beartype
def unshard(
    locals_by_rank: "Sequence[Tensor] | Mapping[int, Tensor]",
    sharding: Sharding,
    *,
    shape: tuple[int, ...] | None = None,
    check_replicas: bool = True,
) -> Tensor:
    """The full tensor from every rank's local tensor (inverse of :func:`shard`).

    ``Partial`` axes are reduced (in rank order). With ``check_replicas`` (default),
    ranks that should hold the same data along ``Replicate`` axes are compared bitwise
    and a mismatch raises ``SpecError`` naming the ranks. ``shape`` defaults to the
    shape implied by the local shapes.
    """
    mesh = sharding.mesh
    locs = _as_rank_list(locals_by_rank, mesh.size)
    dtypes = {t.dtype for t in locs}
    if len(dtypes) != 1:
        raise SpecError(
            f"unshard got local tensors of several dtypes {sorted(map(str, dtypes))}; all ranks must agree"
        )
    lshapes = [tuple(t.shape) for t in locs]
    if len({len(s) for s in lshapes}) != 1:
        raise SpecError(f"unshard got local tensors of different ranks (ndim): {lshapes}")
    gshape = shape if shape is not None else infer_global_shape(lshapes, sharding)
    check_sharding(gshape, sharding)
    for r, s in enumerate(lshapes):
        want = local_shape(gshape, sharding, r)
        if s != want:
            raise SpecError(
                f"rank {r} holds a local tensor of shape {s}, but {sharding} on global shape {gshape} "
                f"gives it shape {want}"
            )
    out = torch.empty(gshape, dtype=locs[0].dtype, device=locs[0].device)
    shard_axes = [
        i for i, p in enumerate(sharding.placements) if isinstance(p, (Shard, StridedShard))
    ]
    rep_axes = [i for i, p in enumerate(sharding.placements) if isinstance(p, Replicate)]
    part_axes = [i for i, p in enumerate(sharding.placements) if isinstance(p, Partial)]
    ops = {p.op for p in sharding.placements if isinstance(p, Partial)}
    if len(ops) > 1:
        raise SpecError(
            f"{sharding} mixes Partial ops {sorted(ops)}; the reduction order would be ambiguous"
        )
    op = ops.pop() if ops else "sum"

    def ranks_for(shard_c: tuple[int, ...], rep_c: tuple[int, ...]) -> list[int]:
        rs = []
        for part_c in itertools.product(*(range(mesh.sizes[i]) for i in part_axes)):
            c = [0] * mesh.ndim
            for i, v in zip(shard_axes, shard_c, strict=True):
                c[i] = v
            for i, v in zip(rep_axes, rep_c, strict=True):
                c[i] = v
            for i, v in zip(part_axes, part_c, strict=True):
                c[i] = v
            rs.append(mesh.rank(c))
        return rs

    rep_space = list(itertools.product(*(range(mesh.sizes[i]) for i in rep_axes)))
    for shard_c in itertools.product(*(range(mesh.sizes[i]) for i in shard_axes)):
        first_ranks = ranks_for(shard_c, rep_space[0])
        value = _reduce([locs[r] for r in first_ranks], op, first_ranks)
        if check_replicas and len(rep_space) > 1:
            ref = as_bytes(value)
            for rep_c in rep_space[1:]:
                rs = ranks_for(shard_c, rep_c)
                other = _reduce([locs[r] for r in rs], op, rs)
                if not torch.equal(ref, as_bytes(other)):
                    raise SpecError(
                        f"replicas disagree: ranks {first_ranks} and {rs} should hold the same data under "
                        f"{sharding} but differ; pass check_replicas=False to take the first replica"
                    )
        for g, loc in local_pieces(gshape, sharding, first_ranks[0]):
            out[g.slices()] = value[loc.slices()]
    return out
