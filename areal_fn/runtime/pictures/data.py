"""What the pictures show, computed without a plotting library.

- :class:`RankGrid`: the ranks of one component laid out as its first mesh (the first
  axis down, the others across, rank order row-major; a 1-D mesh is one row), each cell with its global rank
  numbers, pipeline stage and weight bytes. A grid wider than ``max_cols`` or taller
  than ``max_rows`` is summarised: each cell then stands for a block of neighbouring
  columns and rows (at most ``ceil(cols / max_cols)`` by ``ceil(rows / max_rows)``), so
  a 4096-rank plan still gives a grid of at most ``max_rows x max_cols`` cells; a cell
  whose rows are several pipeline stages records the range.
- :class:`StageLoads`: parameters per pipeline chunk (Megatron's model chunks in
  layer order; chunk ``j`` runs on stage ``j % pp``), with its stage, virtual stage
  and layer count.

Bytes per rank come from the layout's census (ranks that differ only along axes that
shard nothing are counted once), so a large world costs about what a small one does.
"""

import math

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.pipeline.costs import param_costs
from areal_fn.pipeline.partition import StagePlan
from areal_fn.plans.advisor.census import CensusIndex, census_of
from areal_fn.sharding.mesh import Axis
from areal_fn.strategy.allocation import Component
from areal_fn.typecheck import beartype

__all__ = ["GridCell", "RankGrid", "StageLoads", "rank_grid_of", "stage_loads_of"]


@attrs.frozen(kw_only=True)
class GridCell:
    """One cell of a :class:`RankGrid`: the global ranks it stands for (ascending),
    the pipeline stages they serve (``first_stage..last_stage``, one stage unless rows
    are summarised) and their weight bytes."""

    row: int
    col: int
    ranks: tuple[int, ...]
    first_stage: int
    last_stage: int
    min_bytes: int
    max_bytes: int

    @property
    def runs(self) -> tuple[range, ...]:
        """The ranks as maximal runs of consecutive numbers."""
        out: list[range] = []
        for r in self.ranks:
            if out and out[-1].stop == r:
                out[-1] = range(out[-1].start, r + 1)
            else:
                out.append(range(r, r + 1))
        return tuple(out)

    @property
    def label(self) -> str:
        """``8``; ``8-15`` for a run; ``0-1, 32-33`` for two runs; ``0..993 (16 ranks)``
        for more."""
        runs = self.runs
        if len(runs) <= 2:
            return ", ".join(
                str(g.start) if len(g) == 1 else f"{g.start}-{g.stop - 1}" for g in runs
            )
        return f"{self.ranks[0]}..{self.ranks[-1]} ({len(self.ranks)} ranks)"


@attrs.frozen(kw_only=True)
class RankGrid:
    """The ranks of one component on a ``rows x cols`` grid of cells (row-major).

    ``row_axis`` is the mesh axis down (``""`` for a 1-D mesh, one row), ``col_axes`` the axes flattened across (the last
    fastest); ``row_ticks`` label each row of cells with its ``row_axis`` coordinate
    (``pp=0``, or ``pp=0-3`` for a block), ``col_ticks`` each column with its index in
    the flattened axes (``5``, or ``0-127``); ``ranks_per_cell`` is 1 unless summarised.
    """

    title: str
    mesh: str
    row_axis: str
    col_axes: tuple[str, ...]
    rows: int
    cols: int
    row_ticks: tuple[str, ...]
    col_ticks: tuple[str, ...]
    cells: tuple[GridCell, ...]
    stages: int
    dtype: str
    ranks_per_cell: int

    @property
    def summarised(self) -> bool:
        return self.ranks_per_cell > 1


@attrs.frozen(kw_only=True)
class StageLoads:
    """Parameters of each pipeline chunk, in layer order (``loads[j]`` for chunk ``j``)."""

    title: str
    loads: tuple[float, ...]
    stage_of: tuple[int, ...]
    virtual_of: tuple[int, ...]
    layers_of: tuple[int, ...]
    stages: int
    vpp: int
    unit: str

    @property
    def mean(self) -> float:
        return math.fsum(self.loads) / len(self.loads)

    @property
    def imbalance(self) -> float:
        """The largest chunk load over the mean (1.0: perfectly even)."""
        return max(self.loads) / self.mean if self.mean > 0 else 1.0


def _blocks(n: int, most: int) -> list[range]:
    """``n`` indices in at most ``most`` consecutive blocks of ``ceil(n / most)``."""
    size = -(-n // most)
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def _span(block: range) -> str:
    return str(block.start) if len(block) == 1 else f"{block.start}-{block.stop - 1}"


@beartype
def rank_grid_of(
    model_name: str,
    model: ModelSpec,
    component: Component,
    layout: Layout,
    *,
    first_rank: int = 0,
    max_rows: int = 16,
    max_cols: int = 16,
) -> RankGrid:
    """The rank grid of ``component``'s ``layout``; ``first_rank`` is the component's
    first global rank (the cells carry global ranks, as ``areal-fn plan`` prints them)."""
    for name, value, least in (
        ("first_rank", first_rank, 0),
        ("max_rows", max_rows, 1),
        ("max_cols", max_cols, 1),
    ):
        if value < least:
            raise SpecError(f"rank_grid_of: {name}={value} must be >= {least}")
    mesh = layout.meshes[0]
    # a 1-D mesh lies across; otherwise its first axis runs down
    down, across = (mesh.names[:1], mesh.names[1:]) if mesh.ndim > 1 else ((), mesh.names)
    rows = mesh.sizes[0] if down else 1
    cols = mesh.size // rows
    index = CensusIndex(census_of(layout))
    size = DTYPE_BYTES[model.dtype]
    by_key: dict[tuple[tuple[int, ...], ...], int] = {}

    def nbytes(rank: int) -> int:
        k = index.key(rank)
        if k not in by_key:
            by_key[k] = index.share(rank).numel * size
        return by_key[k]

    row_blocks, col_blocks = _blocks(rows, max_rows), _blocks(cols, max_cols)
    cells = []
    for i, rb in enumerate(row_blocks):
        for j, cb in enumerate(col_blocks):
            local = [r * cols + c for r in rb for c in cb]
            stages = {index.stage(r) for r in local}
            held = [nbytes(r) for r in local]
            cells.append(
                GridCell(
                    row=i,
                    col=j,
                    ranks=tuple(first_rank + r for r in local),
                    first_stage=min(stages),
                    last_stage=max(stages),
                    min_bytes=min(held),
                    max_bytes=max(held),
                )
            )
    last = first_rank + layout.world_size - 1
    return RankGrid(
        title=f"{model_name} under {component}: ranks {first_rank}-{last}",
        mesh=str(mesh),
        row_axis=down[0] if down else "",
        col_axes=across,
        rows=len(row_blocks),
        cols=len(col_blocks),
        row_ticks=tuple(f"{down[0]}={_span(b)}" if down else "" for b in row_blocks),
        col_ticks=tuple(_span(b) for b in col_blocks),
        cells=tuple(cells),
        stages=mesh.axis_size(Axis.PP) if Axis.PP in mesh.names else 1,
        dtype=model.dtype,
        ranks_per_cell=len(row_blocks[0]) * len(col_blocks[0]),
    )


@beartype
def stage_loads_of(
    model_name: str, model: ModelSpec, component: Component, layout: Layout
) -> StageLoads | None:
    """Parameters per pipeline chunk of a layout that has stages (``None`` otherwise):
    the layout's own stage split, weighed by :func:`~areal_fn.pipeline.costs.param_costs`
    (whole chunks, before tensor or expert parallelism splits them; the embedding on
    the first chunk, the final norm and output layer on the last)."""
    if layout.stages is None:
        return None
    dims = component.dims
    costs = param_costs(model)
    plan = StagePlan(
        costs=costs.layers,
        num_stages=dims.pp,
        vpp=dims.vpp,
        stage_lengths=layout.stages.stage_lengths,
        first_extra=costs.embedding,
        last_extra=costs.head,
    )
    return StageLoads(
        title=f"{model_name} under {component}: parameters per pipeline chunk",
        loads=plan.chunk_loads,
        stage_of=plan.chunk_ranks,
        virtual_of=plan.chunk_virtual_stages,
        layers_of=plan.stage_lengths,
        stages=dims.pp,
        vpp=dims.vpp,
        unit=costs.unit,
    )
