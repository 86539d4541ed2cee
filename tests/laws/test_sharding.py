"""Laws of the sharding algebra: tiling, round trips, determinism, repr."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_fn import (
    Box,
    Mesh,
    Partial,
    PartitionSpec,
    Replicate,
    Shard,
    Sharding,
    SpecError,
    StridedShard,
    TensorSpec,
    from_partition_spec,
    local_boxes,
    local_pieces,
    local_shape,
    shard,
    to_partition_spec,
    unshard,
)
from areal_fn.sharding.shard import as_bytes
from areal_fn.testing import meshes, shapes, sharded_shapes, shardings, tensors

NS = {
    "Box": Box,
    "Mesh": Mesh,
    "Partial": Partial,
    "PartitionSpec": PartitionSpec,
    "Replicate": Replicate,
    "Shard": Shard,
    "Sharding": Sharding,
    "StridedShard": StridedShard,
    "TensorSpec": TensorSpec,
}


@given(sharded_shapes())
def test_boxes_tile_the_tensor_once_per_replica(case):
    shape, s = case
    count = torch.zeros(shape, dtype=torch.int64)
    for r in range(s.mesh.size):
        pieces = local_pieces(shape, s, r)
        lshape = local_shape(shape, s, r)
        # local boxes tile the local tensor exactly
        local_count = torch.zeros(lshape, dtype=torch.int64)
        for g, loc in pieces:
            assert g.shape == loc.shape
            assert not g.is_empty
            count[g.slices()] += 1
            local_count[loc.slices()] += 1
        assert bool((local_count == 1).all())
        assert sum(g.numel for g, _ in pieces) == math.prod(lshape)
    assert bool((count == s.num_replicas).all())


@given(st.data())
def test_unshard_inverts_shard_bitwise(data):
    shape = data.draw(shapes())
    s = data.draw(shardings(len(shape), partial_ops=()))
    t = data.draw(tensors(shape))
    locs = [shard(t, s, r) for r in range(s.mesh.size)]
    for r, loc in enumerate(locs):
        assert tuple(loc.shape) == local_shape(shape, s, r)
        assert loc.is_contiguous()
    assert torch.equal(as_bytes(unshard(locs, s)), as_bytes(t))


@given(st.data())
def test_unshard_inverts_shard_with_partial(data):
    shape = data.draw(shapes())
    s = data.draw(shardings(len(shape), partial_ops=("sum", "max", "min")))
    t = data.draw(tensors(shape, dtypes=(torch.float32, torch.bfloat16, torch.int64), finite=True))
    locs = [shard(t, s, r) for r in range(s.mesh.size)]
    assert torch.equal(as_bytes(unshard(locs, s)), as_bytes(t))


@given(st.data())
def test_unshard_partial_avg_is_close(data):
    shape = data.draw(shapes())
    s = data.draw(shardings(len(shape), partial_ops=("avg",)))
    t = data.draw(tensors(shape, dtypes=(torch.float64,), finite=True)).clamp(-1e6, 1e6)
    locs = [shard(t, s, r) for r in range(s.mesh.size)]
    torch.testing.assert_close(unshard(locs, s), t, rtol=1e-12, atol=0)


@given(sharded_shapes())
def test_unshard_reduces_partial_sums(case):
    shape, s = case
    if not any(isinstance(p, Partial) and p.op == "sum" for p in s.placements):
        s = Sharding(
            mesh=Mesh(names=(*s.mesh.names, "px"), sizes=(*s.mesh.sizes, 3)),
            placements=(*s.placements, Partial()),
        )
    if any(isinstance(p, Partial) and p.op != "sum" for p in s.placements):
        return
    g = torch.Generator().manual_seed(0)
    locs = [torch.randint(-5, 6, local_shape(shape, s, r), generator=g) for r in range(s.mesh.size)]
    # expected: sum, over the ranks of each partial group, of their pieces
    out = unshard(locs, s, check_replicas=False)
    expect = torch.zeros(shape, dtype=torch.int64)
    rep_axes = [i for i, p in enumerate(s.placements) if isinstance(p, Replicate)]
    for r in range(s.mesh.size):
        if any(s.mesh.coords(r)[i] != 0 for i in rep_axes):
            continue
        for gbox, lbox in local_pieces(shape, s, r):
            expect[gbox.slices()] += locs[r][lbox.slices()]
    assert torch.equal(out, expect)


@given(sharded_shapes(partial_ops=()))
def test_replica_mismatch_is_reported(case):
    shape, s = case
    if s.num_replicas == 1 or math.prod(shape) == 0:
        return
    t = torch.arange(math.prod(shape)).reshape(shape)
    locs = [shard(t, s, r).clone() for r in range(s.mesh.size)]
    last = next(r for r in reversed(range(s.mesh.size)) if locs[r].numel())
    locs[last].view(-1)[0] += 1
    try:
        unshard(locs, s)
    except SpecError as e:
        assert "replicas disagree" in str(e)
    else:
        raise AssertionError("a replica mismatch went unnoticed")


@given(sharded_shapes())
def test_geometry_is_deterministic(case):
    shape, s = case
    for r in range(s.mesh.size):
        assert local_pieces(shape, s, r) == local_pieces(shape, s, r)
        assert local_boxes(shape, s, r) == tuple(g for g, _ in local_pieces(shape, s, r))


@given(st.data())
def test_partition_spec_round_trip(data):
    mesh = data.draw(meshes(max_axes=4))
    ndim = data.draw(st.integers(1, 3))
    # assign every axis to one dim or to none, in a random major-to-minor order
    order = data.draw(st.permutations(mesh.names))
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for a in order:
        d = data.draw(st.integers(-1, ndim - 1))
        if d >= 0:
            entries[d].append(a)
    spec = PartitionSpec(entries=tuple(tuple(e) for e in entries))
    s = from_partition_spec(spec, mesh)
    back = to_partition_spec(s, ndim)
    assert from_partition_spec(back, mesh) == s
    # sizes of 1 make some orders indistinguishable; otherwise the spec comes back as is
    if all(mesh.axis_size(a) > 1 for e in spec.entries for a in e):
        assert back == spec


@given(st.data())
def test_partition_spec_geometry_is_jax_geometry(data):
    """On evenly divisible shapes, blocks follow JAX's mixed-radix (major-to-minor) rule."""
    mesh = data.draw(meshes(max_axes=3, max_world=24))
    ndim = data.draw(st.integers(1, 2))
    order = data.draw(st.permutations(mesh.names))
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for a in order:
        d = data.draw(st.integers(-1, ndim - 1))
        if d >= 0:
            entries[d].append(a)
    mult = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape = tuple(
        m * math.prod(mesh.axis_size(a) for a in e) for m, e in zip(mult, entries, strict=True)
    )
    s = from_partition_spec(PartitionSpec(entries=tuple(tuple(e) for e in entries)), mesh)
    for r in range(mesh.size):
        c = dict(zip(mesh.names, mesh.coords(r), strict=True))
        ranges = []
        for d, e in enumerate(entries):
            idx = 0
            for a in e:
                idx = idx * mesh.axis_size(a) + c[a]
            block = shape[d] // math.prod(mesh.axis_size(a) for a in e)
            ranges.append((idx * block, (idx + 1) * block))
        assert local_boxes(shape, s, r) == (Box(ranges=tuple(ranges)),)


@given(sharded_shapes())
def test_to_partition_spec_is_lossless_or_refuses(case):
    shape, s = case
    try:
        spec = to_partition_spec(s, len(shape))
    except SpecError:
        return
    assert from_partition_spec(spec, s.mesh) == s


@given(sharded_shapes())
def test_repr_evaluates_back(case):
    shape, s = case
    for x in (s, s.mesh, *s.placements, TensorSpec(name="w", shape=shape, dtype="bfloat16")):
        assert eval(repr(x), NS) == x
    for b in local_boxes(shape, s, 0):
        assert eval(repr(b), NS) == b


@given(meshes())
def test_mesh_coords_rank_inverse_and_groups_partition(mesh):
    for r in range(mesh.size):
        assert mesh.rank(mesh.coords(r)) == r
    for axis in mesh.names:
        groups = mesh.groups(axis)
        flat = sorted(x for g in groups for x in g)
        assert flat == list(range(mesh.size))
        for g in groups:
            assert len(g) == mesh.axis_size(axis)
            cs = [mesh.coords(x) for x in g]
            i = mesh.axis_index(axis)
            assert [c[i] for c in cs] == list(range(len(g)))
            assert len({c[:i] + c[i + 1 :] for c in cs}) == 1


@given(meshes(max_axes=3), st.data())
def test_mesh_split_and_flatten_keep_rank_order(mesh, data):
    axis = data.draw(st.sampled_from(mesh.names))
    size = mesh.axis_size(axis)
    a = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    split = mesh.split(axis, hi_part=a, lo_part=size // a)
    assert split.size == mesh.size
    i = mesh.axis_index(axis)
    for r in range(mesh.size):
        c, sc = mesh.coords(r), split.coords(r)
        assert sc[i] * (size // a) + sc[i + 1] == c[i]
    assert split.flatten(("hi_part", "lo_part"), axis) == mesh


def test_placements_take_dtensor_positional_forms():
    """``Shard(0)``, ``StridedShard(0, 2)``, ``Partial("max")`` as DTensor spells them."""
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Shard as TShard

    from areal_fn.sharding.placement import Partial, Shard, StridedShard

    assert Shard(1) == Shard(dim=1) and Shard(1).dim == TShard(1).dim
    assert StridedShard(0, 2) == StridedShard(dim=0, split_factor=2)
    assert Partial("max") == Partial(op="max") and Partial("max").op == TPartial("max").reduce_op
    assert repr(Shard(1)) == "Shard(dim=1)"  # repr stays keyword-style, valid Python
