"""Text pictures of shardings: which rank holds which block of a 2-D tensor.

``rank_grid((4, 6), Sharding(mesh=Mesh.of(dp=2, tp=2), placements=(Shard(dim=0), Shard(dim=1))))``::

       0  1  2  3  4  5
    0  0  0  0  1  1  1
    1  0  0  0  1  1  1
    2  2  2  2  3  3  3
    3  2  2  2  3  3  3

Rows are labelled on the left, columns on top; a cell lists every rank holding it
(``0,4`` when replicated). A dim longer than ``max_side`` is block-compressed: runs of
consecutive indices held by the same ranks collapse into one labelled ``start:stop``.
"""

import itertools

from areal_fn.errors import SpecError
from areal_fn.sharding.sharding import Sharding, check_sharding, local_boxes
from areal_fn.typecheck import beartype

Interval = tuple[int, int]


def _cuts(length: int, edges: set[int]) -> tuple[Interval, ...]:
    points = sorted({0, length} | {e for e in edges if 0 <= e <= length})
    return tuple((a, b) for a, b in itertools.pairwise(points) if a < b)


def _merge(
    intervals: tuple[Interval, ...], keys: list[tuple[tuple[int, ...], ...]]
) -> tuple[tuple[Interval, ...], list[tuple[tuple[int, ...], ...]]]:
    """Merge consecutive intervals whose keys (their row/column of holders) are equal."""
    out_iv: list[Interval] = []
    out_keys: list[tuple[tuple[int, ...], ...]] = []
    for iv, key in zip(intervals, keys, strict=True):
        if out_keys and out_keys[-1] == key:
            out_iv[-1] = (out_iv[-1][0], iv[1])
        else:
            out_iv.append(iv)
            out_keys.append(key)
    return tuple(out_iv), out_keys


def _units(intervals: tuple[Interval, ...]) -> tuple[tuple[Interval, int], ...]:
    """Every index of every interval, with the interval it came from."""
    return tuple(((i, i + 1), k) for k, (a, b) in enumerate(intervals) for i in range(a, b))


def _label(iv: Interval) -> str:
    a, b = iv
    return str(a) if b == a + 1 else f"{a}:{b}"


@beartype
def holders(
    shape: tuple[int, ...], sharding: Sharding, *, max_side: int = 16
) -> tuple[tuple[Interval, ...], tuple[Interval, ...], tuple[tuple[tuple[int, ...], ...], ...]]:
    """The grid behind :func:`rank_grid`: row intervals, column intervals, and for each
    cell the sorted ranks holding it (``Partial`` axes hold partial values: listed too).

    Dims of length at most ``max_side`` come one index per interval; longer dims are
    block-compressed (consecutive indices with the same holders merge).
    """
    if len(shape) != 2:
        raise SpecError(
            f"rank_grid draws 2-D tensors; shape {shape} has {len(shape)} dims; "
            "reshape to 2-D first (e.g. (n, 1) for a vector)"
        )
    if isinstance(max_side, bool) or max_side < 1:
        raise SpecError(f"max_side={max_side!r} must be an int >= 1")
    check_sharding(shape, sharding)
    boxes = [(r, b) for r in range(sharding.mesh.size) for b in local_boxes(shape, sharding, r)]
    rows = _cuts(shape[0], {e for _, b in boxes for e in b.ranges[0]})
    cols = _cuts(shape[1], {e for _, b in boxes for e in b.ranges[1]})

    def held(r_iv: Interval, c_iv: Interval) -> tuple[int, ...]:
        found = {
            r
            for r, b in boxes
            if b.ranges[0][0] <= r_iv[0]
            and r_iv[1] <= b.ranges[0][1]
            and b.ranges[1][0] <= c_iv[0]
            and c_iv[1] <= b.ranges[1][1]
        }
        return tuple(sorted(found))

    cells = [[held(r, c) for c in cols] for r in rows]
    # Block-compress long dims: merge equal consecutive rows, then columns.
    if shape[0] > max_side:
        rows, row_keys = _merge(rows, [tuple(row) for row in cells])
        cells = [list(k) for k in row_keys]
    if shape[1] > max_side:
        col_keys = [tuple(row[j] for row in cells) for j in range(len(cols))]
        cols, merged = _merge(cols, col_keys)
        cells = [[merged[j][i] for j in range(len(cols))] for i in range(len(rows))]
    # Expand short dims to one index per row/column.
    if shape[0] <= max_side:
        unit_rows = _units(rows)
        rows = tuple(iv for iv, _ in unit_rows)
        cells = [cells[k] for _, k in unit_rows]
    if shape[1] <= max_side:
        unit_cols = _units(cols)
        cols = tuple(iv for iv, _ in unit_cols)
        cells = [[row[k] for _, k in unit_cols] for row in cells]
    return rows, cols, tuple(tuple(row) for row in cells)


@beartype
def rank_grid(shape: tuple[int, ...], sharding: Sharding, *, max_side: int = 16) -> str:
    """A character grid of a 2-D tensor: each cell shows the rank(s) holding it.

    Columns are labelled on the first line, rows at the start of every other line;
    labels are an index or a half-open ``start:stop`` block; cells list ranks joined
    by ``,``. Tokens never contain spaces, so the grid parses back by splitting.
    An empty tensor renders as one line saying so.
    """
    rows, cols, cells = holders(shape, sharding, max_side=max_side)
    if not rows or not cols:
        return f"(empty {shape[0]}x{shape[1]} tensor)"
    table = [["", *(_label(c) for c in cols)]]
    for r_iv, row in zip(rows, cells, strict=True):
        table.append([_label(r_iv), *(",".join(map(str, h)) or "." for h in row)])
    widths = [max(len(line[j]) for line in table) for j in range(len(table[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in table
    )
