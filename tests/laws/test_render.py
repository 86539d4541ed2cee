"""Laws of ``rank_grid``: the picture says exactly what ``local_boxes`` says."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import SpecError
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Replicate, Shard, StridedShard
from areal_fn.sharding.render import rank_grid
from areal_fn.sharding.sharding import Sharding, local_boxes
from areal_fn.testing import meshes, shardings


def _parse_label(label: str) -> tuple[int, int]:
    if ":" in label:
        a, b = label.split(":")
        return int(a), int(b)
    return int(label), int(label) + 1


def _parse(grid: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[list[str]]]:
    lines = grid.split("\n")
    cols = [_parse_label(t) for t in lines[0].split()]
    rows, cells = [], []
    for line in lines[1:]:
        label, *row = line.split()
        rows.append(_parse_label(label))
        cells.append(row)
    return rows, cols, cells


def _tiles(intervals: list[tuple[int, int]], length: int) -> bool:
    return (
        bool(intervals)
        and intervals[0][0] == 0
        and intervals[-1][1] == length
        and all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(intervals))
        and intervals[-1][0] < intervals[-1][1]
    )


def _holders_of(i: int, j: int, shape: tuple[int, int], s: Sharding) -> str:
    ranks = [
        r
        for r in range(s.mesh.size)
        if any(
            lo0 <= i < hi0 and lo1 <= j < hi1
            for (lo0, hi0), (lo1, hi1) in (b.ranges for b in local_boxes(shape, s, r))
        )
    ]
    return ",".join(map(str, ranks)) or "."


@st.composite
def grid_cases(draw: st.DrawFn) -> tuple[tuple[int, int], Sharding, int]:
    shape = (draw(st.integers(0, 20)), draw(st.integers(0, 20)))
    mesh = draw(meshes(max_axes=3, max_world=8))
    return shape, draw(shardings(2, mesh=mesh)), draw(st.integers(1, 12))


@given(grid_cases())
def test_grid_cells_agree_with_local_boxes(case: tuple[tuple[int, int], Sharding, int]) -> None:
    shape, s, max_side = case
    grid = rank_grid(shape, s, max_side=max_side)
    if 0 in shape:
        assert grid == f"(empty {shape[0]}x{shape[1]} tensor)"
        return
    rows, cols, cells = _parse(grid)
    assert _tiles(rows, shape[0]) and _tiles(cols, shape[1]), grid
    for (r0, r1), row in zip(rows, cells, strict=True):
        assert len(row) == len(cols), grid
        for (c0, c1), cell in zip(cols, row, strict=True):
            for i in range(r0, r1):
                for j in range(c0, c1):
                    assert cell == _holders_of(i, j, shape, s), (grid, i, j)


@given(grid_cases())
def test_short_dims_are_unit_and_long_dims_are_maximally_compressed(
    case: tuple[tuple[int, int], Sharding, int],
) -> None:
    shape, s, max_side = case
    if 0 in shape:
        return
    rows, cols, cells = _parse(rank_grid(shape, s, max_side=max_side))
    if shape[0] <= max_side:
        assert all(b - a == 1 for a, b in rows)
    else:
        assert all(x != y for x, y in itertools.pairwise(cells))
    if shape[1] <= max_side:
        assert all(b - a == 1 for a, b in cols)
    else:
        columns = [[row[j] for row in cells] for j in range(len(cols))]
        assert all(x != y for x, y in itertools.pairwise(columns))


def test_example_grids() -> None:
    mesh = Mesh.of(dp=2, tp=2)
    assert rank_grid((4, 6), Sharding(mesh=mesh, placements=(Shard(dim=0), Shard(dim=1)))) == (
        "   0  1  2  3  4  5\n"
        "0  0  0  0  1  1  1\n"
        "1  0  0  0  1  1  1\n"
        "2  2  2  2  3  3  3\n"
        "3  2  2  2  3  3  3"
    )
    strided = Sharding(
        mesh=Mesh.of(dp=2, tp=4),
        placements=(StridedShard(dim=0, split_factor=4), Shard(dim=0)),
    )
    assert rank_grid((4096, 4096), strided).split("\n")[:3] == [
        "           0:4096",
        "    0:512       0",
        " 512:1024       4",
    ]
    replicated = Sharding(mesh=mesh, placements=(Replicate(), Shard(dim=1)))
    assert rank_grid((64, 64), replicated) == "      0:32  32:64\n0:64   0,2    1,3"


@pytest.mark.parametrize(
    ("shape", "kwargs", "match"),
    [
        ((8,), {}, r"rank_grid draws 2-D tensors; shape \(8,\) has 1 dims"),
        ((2, 2, 2), {}, r"shape \(2, 2, 2\) has 3 dims; reshape to 2-D first"),
        ((4, 4), {"max_side": 0}, r"max_side=0 must be an int >= 1"),
    ],
)
def test_rank_grid_errors(shape: tuple[int, ...], kwargs: dict[str, int], match: str) -> None:
    s = Sharding(mesh=Mesh.of(tp=2), placements=(Replicate(),))
    with pytest.raises(SpecError, match=match):
        rank_grid(shape, s, **kwargs)
