"""Hypothesis strategies for pipeline partitioning: layer costs, problems, stage plans.

Valid by construction: the layer count is drawn at least ``num_stages * vpp`` (at least
``num_stages * vpp - 2`` with ``allow_empty_ends``), ``vpp`` is 1 when there is one
stage, and stage lengths come from distinct cut points.
"""

import attrs
from hypothesis import strategies as st

from areal_fn.pipeline.partition import StagePlan

__all__ = ["PipelineProblem", "layer_costs", "pipeline_problems", "stage_plans"]


@attrs.frozen(kw_only=True)
class PipelineProblem:
    """The inputs of one :func:`~areal_fn.pipeline.partition.partition_pipeline` call."""

    costs: tuple[float, ...]
    num_stages: int
    vpp: int = 1
    first_extra: float = 0.0
    last_extra: float = 0.0
    allow_empty_ends: bool = False

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.vpp


def _cost() -> st.SearchStrategy[float]:
    """Positive finite costs: small integers (many ties), quarters, and any float in
    ``[1e-3, 1e3]`` (sums that round)."""
    return st.one_of(
        st.integers(1, 20).map(float),
        st.integers(1, 40).map(lambda q: q / 4),
        st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False),
    )


def _extra() -> st.SearchStrategy[float]:
    return st.one_of(st.just(0.0), _cost())


@st.composite
def layer_costs(draw: st.DrawFn, *, min_layers: int = 1, max_layers: int = 12) -> tuple[float, ...]:
    """Per-layer costs (positive, finite), ``min_layers..max_layers`` of them."""
    return tuple(draw(st.lists(_cost(), min_size=min_layers, max_size=max_layers)))


@st.composite
def pipeline_problems(
    draw: st.DrawFn,
    *,
    max_layers: int = 9,
    max_stages: int = 3,
    max_vpp: int = 3,
    extras: bool = True,
    allow_empty_ends: bool = False,
) -> PipelineProblem:
    """A solvable problem: ``num_stages * vpp <= len(costs) <= max(max_layers, that)``;
    with ``allow_empty_ends`` the first and the last chunk may be empty, so
    ``len(costs) >= max(1, num_stages * vpp - 2)``."""
    s = draw(st.integers(1, max_stages))
    v = 1 if s == 1 else draw(st.integers(1, max_vpp))
    k = s * v
    least = max(1, k - 2) if allow_empty_ends else k
    costs = draw(layer_costs(min_layers=least, max_layers=max(least, max_layers)))
    return PipelineProblem(
        costs=costs,
        num_stages=s,
        vpp=v,
        first_extra=draw(_extra()) if extras else 0.0,
        last_extra=draw(_extra()) if extras else 0.0,
        allow_empty_ends=allow_empty_ends,
    )


@st.composite
def stage_plans(
    draw: st.DrawFn,
    *,
    max_layers: int = 12,
    max_stages: int = 4,
    max_vpp: int = 3,
    allow_empty_ends: bool = False,
) -> StagePlan:
    """An arbitrary valid (not optimised) :class:`StagePlan`; with ``allow_empty_ends``
    its first and last chunk may be empty (cut points drawn over the ``L + 2`` items
    embedding, layers, head)."""
    p = draw(
        pipeline_problems(
            max_layers=max_layers,
            max_stages=max_stages,
            max_vpp=max_vpp,
            allow_empty_ends=allow_empty_ends,
        )
    )
    n = len(p.costs) + (2 if allow_empty_ends else 0)  # items to cut
    cuts = draw(
        st.lists(
            st.integers(1, n - 1) if n > 1 else st.nothing(),
            min_size=p.num_chunks - 1,
            max_size=p.num_chunks - 1,
            unique=True,
        )
    )
    b = [0, *sorted(cuts), n]
    ends = (0, p.num_chunks - 1) if allow_empty_ends else ()  # chunks holding an extra item
    return StagePlan(
        costs=p.costs,
        num_stages=p.num_stages,
        vpp=p.vpp,
        stage_lengths=tuple(b[j + 1] - b[j] - ends.count(j) for j in range(p.num_chunks)),
        first_extra=p.first_extra,
        last_extra=p.last_extra,
        allow_empty_ends=allow_empty_ends,
    )
