"""One table of bad inputs to the core records and functions, with their messages."""

import pytest
import torch

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
    local_shape,
    shard,
    to_partition_spec,
    unshard,
)

M22 = Mesh.of(dp=2, tp=2)

CASES = [
    (
        "zero axis size",
        lambda: Mesh.of(dp=0),
        r"Mesh.sizes=\(0,\) has size 0; every axis size must be an int >= 1",
    ),
    (
        "negative axis size",
        lambda: Mesh.of(dp=2, tp=-4),
        r"has size -4; every axis size must be an int >= 1",
    ),
    ("bool axis size", lambda: Mesh(names=("dp",), sizes=(True,)), r"has size True"),
    (
        "duplicate axis",
        lambda: Mesh(names=("dp", "dp"), sizes=(2, 2)),
        r"repeats axis 'dp'; every axis name must be unique",
    ),
    (
        "bad axis name",
        lambda: Mesh(names=("d p",), sizes=(2,)),
        r"axis name 'd p' is not an ASCII identifier",
    ),
    (
        "names/sizes mismatch",
        lambda: Mesh(names=("dp", "tp"), sizes=(2,)),
        r"Mesh has 2 names \('dp', 'tp'\) but 1 sizes",
    ),
    (
        "rank out of range",
        lambda: M22.coords(4),
        r"rank=4 is outside this mesh of 4 ranks; use 0..3",
    ),
    ("coords out of range", lambda: M22.rank((0, 2)), r"coordinate 2 on axis 'tp' is outside 0..1"),
    (
        "unknown axis",
        lambda: M22.groups("pp"),
        r"mesh axis 'pp' does not exist; this mesh has axes \('dp', 'tp'\)",
    ),
    ("bad split", lambda: Mesh.of(tp=8).split("tp", a=3, b=2), r"the factors multiply to 6, not 8"),
    (
        "flatten non adjacent",
        lambda: Mesh.of(a=2, b=2, c=2).flatten(("a", "c"), "ac"),
        r"axes must be adjacent and in mesh order",
    ),
    ("negative shard dim", lambda: Shard(dim=-1), r"Shard.dim=-1 must be an int >= 0"),
    (
        "strided split 0",
        lambda: StridedShard(dim=0, split_factor=0),
        r"StridedShard.split_factor=0 must be an int >= 1",
    ),
    (
        "bad partial op",
        lambda: Partial(op="prod"),
        r"Partial.op='prod' is not a reduction; use one of",
    ),
    (
        "too few placements",
        lambda: Sharding(mesh=M22, placements=(Shard(dim=0),)),
        r"Sharding has 1 placements \(S\(0\)\) for a mesh with 2 axes",
    ),
    (
        "too many placements",
        lambda: Sharding(mesh=Mesh.of(dp=2), placements=(Shard(dim=0), Replicate())),
        r"Sharding has 2 placements",
    ),
    (
        "not a placement",
        lambda: Sharding(mesh=Mesh.of(dp=2), placements=("S0",)),
        r"Sharding.placements\[0\]='S0' is not a placement",
    ),
    (
        "shard dim out of range",
        lambda: local_shape((4, 4), Sharding(mesh=M22, placements=(Shard(dim=2), Replicate())), 0),
        r"Shard\(dim=2\) on mesh axis 'dp' shards dim 2, but the tensor has shape \(4, 4\) \(2 dims\)",
    ),
    (
        "strided dim out of range",
        lambda: local_shape(
            (4,),
            Sharding(mesh=M22, placements=(StridedShard(dim=1, split_factor=2), Shard(dim=0))),
            0,
        ),
        r"StridedShard\(dim=1, split_factor=2\) on mesh axis 'dp' shards dim 1",
    ),
    (
        "rank outside mesh",
        lambda: local_shape((4,), Sharding(mesh=M22, placements=(Shard(dim=0), Replicate())), 7),
        r"rank=7 is outside this mesh of 4 ranks",
    ),
    (
        "unshard missing rank",
        lambda: unshard(
            {0: torch.zeros(2), 1: torch.zeros(2)},
            Sharding(mesh=M22, placements=(Shard(dim=0), Replicate())),
        ),
        r"missing ranks \[2, 3\]",
    ),
    (
        "unshard wrong count",
        lambda: unshard(
            [torch.zeros(2)], Sharding(mesh=M22, placements=(Shard(dim=0), Replicate()))
        ),
        r"got 1 local tensors for a mesh of 4 ranks",
    ),
    (
        "unshard wrong local shape",
        lambda: unshard(
            [torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(3)],
            Sharding(mesh=M22, placements=(Shard(dim=0), Replicate())),
            shape=(4,),
        ),
        r"rank 3 holds a local tensor of shape \(3,\)",
    ),
    (
        "unshard mixed dtypes",
        lambda: unshard(
            [torch.zeros(2), torch.zeros(2, dtype=torch.int64)],
            Sharding(mesh=Mesh.of(dp=2), placements=(Shard(dim=0),)),
        ),
        r"local tensors of several dtypes",
    ),
    (
        "avg of ints",
        lambda: unshard(
            [torch.ones(2, dtype=torch.int64)] * 2,
            Sharding(mesh=Mesh.of(dp=2), placements=(Partial(op="avg"),)),
        ),
        r"Partial\(op='avg'\) over ranks \[0, 1\] holds dtype torch.int64",
    ),
    (
        "mixed partial ops",
        lambda: unshard(
            [torch.ones(2)] * 4,
            Sharding(mesh=M22, placements=(Partial(op="sum"), Partial(op="max"))),
        ),
        r"mixes Partial ops \['max', 'sum'\]",
    ),
    (
        "shard non tensor",
        lambda: shard([1, 2], Sharding(mesh=Mesh.of(dp=2), placements=(Shard(dim=0),)), 0),
        r"tensor",
    ),
    (
        "spec unknown axis",
        lambda: from_partition_spec(PartitionSpec.of("pp"), M22),
        r"names mesh axis 'pp', which Mesh\(dp=2, tp=2\) does not have",
    ),
    ("spec axis twice", lambda: PartitionSpec.of("dp", "dp"), r"uses mesh axis 'dp' twice"),
    (
        "spec bad entry",
        lambda: PartitionSpec.of(3),
        r"PartitionSpec entry 0=3 must be None, an axis name or a tuple of axis names",
    ),
    (
        "spec of partial",
        lambda: to_partition_spec(Sharding(mesh=M22, placements=(Partial(), Replicate())), 1),
        r"Partial\(op='sum'\) on mesh axis 'dp' has no PartitionSpec form",
    ),
    (
        "spec of odd strided",
        lambda: to_partition_spec(
            Sharding(mesh=M22, placements=(StridedShard(dim=0, split_factor=3), Shard(dim=0))), 1
        ),
        r"no PartitionSpec expresses them",
    ),
    (
        "box bad range",
        lambda: Box(ranges=((3, 1),)),
        r"Box.ranges\[0\]=\(3, 1\) violates 0 <= start <= stop",
    ),
    (
        "box rank mismatch",
        lambda: Box(ranges=((0, 1),)).intersect(Box(ranges=((0, 1), (0, 1)))),
        r"boxes of different rank",
    ),
    (
        "tensor spec negative dim",
        lambda: TensorSpec(name="w", shape=(4, -1)),
        r"shape=\(4, -1\) has dim -1; every dim must be an int >= 0",
    ),
    (
        "tensor spec dtype",
        lambda: TensorSpec(name="w", shape=(4,), dtype="fp8"),
        r"dtype='fp8' is not a known dtype",
    ),
    (
        "tensor spec empty name",
        lambda: TensorSpec(name="", shape=(4,)),
        r"TensorSpec.name='' must be a non-empty string",
    ),
]


@pytest.mark.parametrize(("what", "call", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_spec_error(what, call, message):
    with pytest.raises((SpecError, TypeError), match=message) as info:
        call()
    if what != "shard non tensor":
        assert isinstance(info.value, SpecError), (
            f"{what}: raised {type(info.value).__name__}, not SpecError"
        )
