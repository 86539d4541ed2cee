"""Matplotlib figures of a :class:`~.data.RankGrid` and of :class:`~.data.StageLoads`.

Both use one colour per pipeline stage (:func:`stage_colors`): a rank's cell and the
bars of the chunks it runs have the same colour. Figures are built with
``matplotlib.figure.Figure`` (no pyplot, no global state, the Agg renderer), with a
fixed size in pixels (constrained layout keeps the legend inside it), titled, with axis
labels and a legend. Every drawn cell and bar carries a ``gid`` (``ranks:8``,
``ranks:0-127``, ``chunk:3``) so a test can find it.

matplotlib is an optional dependency (the ``pictures`` extra); without it these raise
``ModuleNotFoundError`` with a one-line remedy (:func:`require_matplotlib`).
"""

import textwrap
from typing import TYPE_CHECKING, Any

from areal_fn.runtime.pictures.data import GridCell, RankGrid, StageLoads

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MISSING_MATPLOTLIB",
    "human_bytes",
    "rank_grid_figure",
    "require_matplotlib",
    "si",
    "stage_colors",
    "stage_loads_figure",
]

MISSING_MATPLOTLIB = (
    "pictures need matplotlib, which is not installed; install the pictures extra: "
    "pip install 'areal-fn[pictures]' (or pip install matplotlib)"
)
DPI = 100
#: cell size in inches: one rank, a block of ranks
CELL = (0.8, 0.55)
BLOCK_CELL = (1.0, 0.6)
MIN_WIDTH_IN = 8.0
MAX_WIDTH_IN = 17.0
HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "++", "--")


def require_matplotlib() -> None:
    """``ModuleNotFoundError`` with the remedy when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError(MISSING_MATPLOTLIB, name="matplotlib") from None


def stage_colors(stages: int) -> tuple[tuple[float, float, float, float], ...]:
    """One RGBA colour per pipeline stage: ``tab10`` up to 10 stages, ``tab20`` up to
    20, evenly spaced ``viridis`` beyond."""
    require_matplotlib()
    from matplotlib import colormaps

    if stages <= 10:
        return tuple(colormaps["tab10"](s) for s in range(stages))
    if stages <= 20:
        return tuple(colormaps["tab20"](s) for s in range(stages))
    return tuple(colormaps["viridis"](s / (stages - 1)) for s in range(stages))


def human_bytes(n: int) -> str:
    """``1.8 GiB``, ``512 B`` (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def si(value: float) -> str:
    """``3.81G``, ``545M``, ``12.3k``: three significant digits, SI prefix."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{prefix}"
    return f"{value:.3g}"


def _figure(width_in: float, height_in: float) -> "Figure":
    from matplotlib.figure import Figure

    width = min(max(width_in, MIN_WIDTH_IN), MAX_WIDTH_IN)
    return Figure(figsize=(width, height_in), dpi=DPI, layout="constrained")


def _wrap(fig: "Figure", text: str, fontsize: float, *, bold: bool = False) -> str:
    """``text`` broken into lines that fit the figure's width at ``fontsize`` points."""
    em = 0.68 if bold else 0.6  # average glyph width of DejaVu Sans, in ems
    chars = int(0.95 * fig.get_figwidth() * 72 / (fontsize * em))
    return "\n".join(textwrap.wrap(text, width=max(chars, 20), break_on_hyphens=False))


def _legend(fig: "Figure", handles: list[Any]) -> None:
    """The legend under the axes, as many entries a row as fit the width."""
    per_row = max(1, int(fig.get_figwidth() / 1.7))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), per_row))


def _titles(fig: "Figure", ax: Any, title: str, subtitle: str) -> None:
    fig.suptitle(_wrap(fig, title, 12, bold=True), fontsize=12, fontweight="bold")
    ax.set_title(_wrap(fig, subtitle, 9), fontsize=9)


def _ink(face: Any) -> str:
    """Black on light faces, white on dark ones (relative luminance, sRGB weights)."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(face)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def _cell_text(cell: GridCell) -> str:
    """The cell's rank(s) over its weight bytes (a range when its ranks differ)."""
    low, high = human_bytes(cell.min_bytes), human_bytes(cell.max_bytes)
    return f"{cell.label}\n{low}" if low == high else f"{cell.label}\n{low}-\n{high}"


def rank_grid_figure(grid: RankGrid) -> "Figure":
    """One cell per rank (or block of ranks), coloured by pipeline stage, labelled with
    its global rank(s) and weight bytes; rows and columns ticked with mesh coordinates."""
    require_matplotlib()
    from matplotlib.patches import Patch, Rectangle

    w, h = BLOCK_CELL if grid.summarised else CELL
    fig = _figure(1.8 + grid.cols * w, 2.2 + grid.rows * h)
    ax = fig.add_subplot()
    colors = stage_colors(grid.stages)
    fontsize = 7 if grid.summarised else 8
    for cell in grid.cells:
        face = colors[cell.first_stage]
        ax.add_patch(
            Rectangle(
                (cell.col, cell.row),
                1,
                1,
                facecolor=face,
                edgecolor="white",
                linewidth=1.5,
                gid=f"ranks:{cell.label}",
            )
        )
        ax.text(
            cell.col + 0.5,
            cell.row + 0.5,
            _cell_text(cell),
            ha="center",
            va="center",
            fontsize=fontsize,
            color=_ink(face),
            gid=f"label:{cell.label}",
        )
    ax.set_xlim(0, grid.cols)
    ax.set_ylim(grid.rows, 0)
    ax.set_xticks([c + 0.5 for c in range(grid.cols)], grid.col_ticks, fontsize=8)
    ax.set_yticks([r + 0.5 for r in range(grid.rows)], grid.row_ticks, fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if len(grid.col_axes) > 1:
        across = " x ".join(grid.col_axes)
        ax.set_xlabel(f"column: index over {across} ({grid.col_axes[-1]} fastest)")
    else:
        ax.set_xlabel(f"column: {grid.col_axes[0]} coordinate")
    ax.set_ylabel(f"row: {grid.row_axis}" if grid.row_axis else "one row")
    each = f"; each cell: up to {grid.ranks_per_cell} ranks" if grid.summarised else ""
    if any(c.last_stage > c.first_stage for c in grid.cells):
        each += "; a cell of several stages has the first one's colour"
    _titles(
        fig,
        ax,
        grid.title,
        f"{grid.mesh}; colour: pipeline stage; text: global rank(s) and weight "
        f"bytes ({grid.dtype}){each}",
    )
    handles: list[Any] = []
    for first, last in sorted({(c.first_stage, c.last_stage) for c in grid.cells}):
        if grid.stages == 1:
            label = "one stage (no pp)"
        else:
            label = f"stage {first}" if first == last else f"stages {first}-{last}"
        handles.append(Patch(facecolor=colors[first], label=label))
    _legend(fig, handles)
    return fig


def stage_loads_figure(loads: StageLoads) -> "Figure":
    """One bar per pipeline chunk in layer order, coloured by the stage that runs it
    (hatched by virtual stage when ``vpp > 1``), each labelled with its load; a dashed
    line at the mean."""
    require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    n = len(loads.loads)
    fig = _figure(2.0 + 0.6 * n, 5.2)
    ax = fig.add_subplot()
    colors = stage_colors(loads.stages)
    bars = ax.bar(
        range(n),
        loads.loads,
        color=[colors[s] for s in loads.stage_of],
        edgecolor="black",
        linewidth=0.5,
    )
    for j, bar in enumerate(bars):
        bar.set_gid(f"chunk:{j}")
        if loads.vpp > 1:
            bar.set_hatch(HATCHES[loads.virtual_of[j] % len(HATCHES)])
    many = n > 24
    ax.axhline(loads.mean, color="black", linestyle="--", linewidth=1, zorder=0.5)
    ax.bar_label(
        bars,
        labels=[si(v) for v in loads.loads],
        padding=2,
        fontsize=7 if many else 8,
        rotation=90 if many else 0,
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
    )
    ax.set_ylim(0, max(loads.loads) * (1.18 if many else 1.1))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: si(v)))
    ticks = [str(j) if many else f"{j}\n{k} layers" for j, k in enumerate(loads.layers_of)]
    ax.set_xticks(range(n), ticks, fontsize=7 if many else 8)
    ax.set_xlabel(
        _wrap(
            fig,
            "pipeline chunk in layer order (chunk j runs on stage j mod pp; "
            "the first adds the embedding, the last the output layer)",
            10,
        )
    )
    ax.set_ylabel(loads.unit)
    _titles(
        fig,
        ax,
        loads.title,
        f"pp={loads.stages}, vpp={loads.vpp}; largest chunk / mean = {loads.imbalance:.3f}",
    )
    handles: list[Any] = [
        Patch(facecolor=colors[s], label=f"stage {s}") for s in range(loads.stages)
    ]
    if loads.vpp > 1:
        handles += [
            Patch(
                facecolor="white",
                edgecolor="black",
                hatch=HATCHES[v % len(HATCHES)],
                label=f"virtual stage {v}",
            )
            for v in range(loads.vpp)
        ]
    handles.append(Line2D([], [], color="black", linestyle="--", label=f"mean {si(loads.mean)}"))
    _legend(fig, handles)
    return fig
