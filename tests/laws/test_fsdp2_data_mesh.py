"""The FSDP2 engine's data mesh: ``dp_shard`` factored into data shards x ``cp``, ``cp`` fastest.

Sequence-parallel groups are the ranks that share ``dp_replicate``, the data part of
the ``dp_shard`` coordinate and ``tp``; checked against the row-major rank formula of
the parameters' mesh (``torch.distributed.init_device_mesh``'s order).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import Fsdp2Options, fsdp2_data_mesh, fsdp2_mesh
from areal_fn.sharding.mesh import Axis, Mesh
from areal_fn.strategy.allocation import ParallelDims


@given(
    replicas=st.sampled_from([1, 2]),
    data=st.sampled_from([1, 2, 3]),
    cp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
)
def test_cp_groups_are_the_fastest_part_of_dp_shard(
    replicas: int, data: int, cp: int, tp: int
) -> None:
    dims = ParallelDims(dp=replicas * data, cp=cp, tp=tp)
    mesh = fsdp2_mesh(dims, Fsdp2Options(hsdp_replicas=replicas))
    dm = fsdp2_data_mesh(mesh, cp)
    assert dm.size == mesh.size and dm.axis_size(Axis.CP) == cp
    shard = data * cp

    def rank(r: int, d: int, c: int, t: int) -> int:  # the parameters' mesh, row-major
        return ((r * shard) + d * cp + c) * tp + t

    want = sorted(
        tuple(rank(r, d, c, t) for c in range(cp))
        for r in range(replicas)
        for d in range(data)
        for t in range(tp)
    )
    assert sorted(dm.groups(Axis.CP)) == want


def test_refuses_a_cp_that_does_not_divide_dp_shard() -> None:
    with pytest.raises(
        LayoutError,
        match=r"^cp=4 does not divide dp_shard=6 of Mesh\(dp_shard=6\); the FSDP2 mesh has "
        r"dp_shard = dp/replicas \* cp",
    ):
        fsdp2_data_mesh(Mesh.of(dp_shard=6), 4)
