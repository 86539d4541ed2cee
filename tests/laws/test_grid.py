"""Laws of the grid a set of boxes cuts a box into (:mod:`areal_fn.sharding.grid`),
against brute force: every cell's holders are the boxes that contain it, and merged runs
cover the cells exactly, each with its holder."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from areal_fn.sharding.grid import grid_cells, grid_cuts, holders_by_cell, merge_runs


@st.composite
def boxes_in(draw: st.DrawFn) -> tuple[tuple[tuple[int, int], ...], list]:
    ndim = draw(st.integers(0, 3))
    outer = tuple((0, draw(st.integers(1, 6))) for _ in range(ndim))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        box = []
        for _, n in outer:
            lo = draw(st.integers(0, n - 1))
            box.append((lo, draw(st.integers(lo + 1, n))))
        boxes.append(tuple(box))
    return outer, boxes


def _points(box):  # type: ignore[no-untyped-def]
    return set(itertools.product(*(range(lo, hi) for lo, hi in box)))


@given(boxes_in())
def test_every_cell_lists_the_boxes_that_contain_it(case) -> None:  # type: ignore[no-untyped-def]
    outer, boxes = case
    cuts = grid_cuts(boxes, outer)
    cells = list(grid_cells(cuts))
    assert set().union(*map(_points, cells)) == _points(outer)  # the cells tile outer
    assert sum(len(_points(c)) for c in cells) == len(_points(outer))
    for cell, held in zip(cells, holders_by_cell(cuts, boxes), strict=True):
        want = [i for i, b in enumerate(boxes) if _points(cell) <= _points(b)]
        assert held == want, (cell, held, want)
        # a cell is inside a box or disjoint from it: the cuts follow every boundary
        assert all(
            not (_points(cell) & _points(boxes[i])) for i in set(range(len(boxes))) - set(want)
        )


@given(boxes_in(), st.data())
def test_merged_runs_cover_the_cells_each_with_its_holder(case, data) -> None:  # type: ignore[no-untyped-def]
    outer, boxes = case
    cells = list(grid_cells(grid_cuts(boxes, outer)))
    given_to = [(c, data.draw(st.integers(0, 2))) for c in cells]
    runs = merge_runs(list(given_to))
    owner = {p: h for c, h in given_to for p in _points(c)}
    got = {}
    for box, h in runs:
        for p in _points(box):
            assert p not in got  # runs do not overlap
            got[p] = h
    assert got == owner
    assert runs == sorted(runs, key=lambda r: r[0])
