"""The grid a set of boxes cuts a box into, and which boxes hold each of its cells.

Planners that give every element of a destination (or of a canonical tensor) to one of
several holders work cell by cell: :func:`grid_cuts` cuts the outer box along every
holder's boundaries, :func:`holders_by_cell` lists, for every cell, the holders whose box
contains it. Each holder visits the cells it covers (its box's ends are cut points), so
the work is the cells the holders cover, not cells times holders (a layer's 128 experts,
each holding one cell of a destination shard).
"""

import itertools
import math
from collections.abc import Iterable, Sequence

Ranges = tuple[tuple[int, int], ...]

__all__ = ["grid_cells", "grid_cuts", "holders_by_cell", "merge_runs"]


def grid_cuts(boxes: Iterable[Ranges], outer: Ranges) -> list[list[int]]:
    """Per dim of ``outer``, its ends and every box boundary strictly inside, sorted."""
    pts = [{lo, hi} for lo, hi in outer]
    for b in boxes:
        for d, ((lo, hi), (blo, bhi)) in enumerate(zip(outer, b, strict=True)):
            if lo < blo < hi:
                pts[d].add(blo)
            if lo < bhi < hi:
                pts[d].add(bhi)
    return [sorted(p) for p in pts]


def grid_cells(cuts: Sequence[Sequence[int]]) -> Iterable[Ranges]:
    """Every cell of the grid ``cuts``, in row-major order."""
    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        yield tuple((c[i], c[i + 1]) for c, i in zip(cuts, idx, strict=True))


def holders_by_cell(cuts: Sequence[Sequence[int]], boxes: Sequence[Ranges]) -> list[list[int]]:
    """For every cell of the grid ``cuts`` (row-major, as :func:`grid_cells`), the
    indices of ``boxes`` that contain it, ascending. Every box must lie inside the grid
    with its ends on cut points (as :func:`grid_cuts` makes them)."""
    counts = [len(c) - 1 for c in cuts]
    strides = [1] * len(counts)
    for d in reversed(range(len(counts) - 1)):
        strides[d] = strides[d + 1] * counts[d + 1]
    where = [{x: i for i, x in enumerate(c)} for c in cuts]
    out: list[list[int]] = [[] for _ in range(math.prod(counts))]
    for n, box in enumerate(boxes):
        spans = [range(w[lo], w[hi]) for w, (lo, hi) in zip(where, box, strict=True)]
        for idx in itertools.product(*spans):
            out[sum(i * st for i, st in zip(idx, strides, strict=True))].append(n)
    return out


def merge_runs(cells: list[tuple[Ranges, int]]) -> list[tuple[Ranges, int]]:
    """Merge grid cells given to the same holder into larger boxes, dim by dim (last dim
    first); the result sorted by box."""
    if not cells:
        return cells
    ndim = len(cells[0][0])
    for d in reversed(range(ndim)):
        groups: dict[tuple, list[tuple[Ranges, int]]] = {}
        for box, h in cells:
            groups.setdefault((h, box[:d] + box[d + 1 :]), []).append((box, h))
        merged: list[tuple[Ranges, int]] = []
        for items in groups.values():
            items.sort(key=lambda x: x[0][d])
            cur = items[0]
            for nxt in items[1:]:
                if cur[0][d][1] == nxt[0][d][0]:
                    r = list(cur[0])
                    r[d] = (cur[0][d][0], nxt[0][d][1])
                    cur = (tuple(r), cur[1])
                else:
                    merged.append(cur)
                    cur = nxt
            merged.append(cur)
        cells = merged
    cells.sort(key=lambda x: x[0])
    return cells
