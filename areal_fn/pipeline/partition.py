"""Pipeline partition: contiguous layer chunks that minimise the heaviest stage.

A model of ``L`` decoder layers with per-layer costs is cut into ``K = num_stages * vpp``
contiguous, non-empty **chunks** in layer order. With virtual pipeline stages
(``vpp > 1``) the chunks interleave over the physical ranks as Megatron-Core does:
chunk ``j`` lives on pipeline rank ``j % num_stages`` as its virtual stage
``j // num_stages``. Chunk 0 also carries ``first_extra`` (the embedding), chunk
``K - 1`` carries ``last_extra`` (final norm, output head and loss).

With ``allow_empty_ends=True`` the first and the last chunk may hold no decoder layer
(only the embedding, only the head and loss: AReaL's problem, Megatron-Core's
``"E|...|L"``); inner chunks still hold at least one. The search then runs on the
``L + 2`` items ``(first_extra, *costs, last_extra)``, cut into ``K`` non-empty chunks:
chunk 0 always holds the embedding item and chunk ``K - 1`` the head item, so these
partitions are exactly the partitions of the layers with possibly empty ends, and
everything below (exact bottleneck, tie-break, rank search) applies unchanged.

:func:`partition_pipeline` returns a :class:`StagePlan`:

1. **Chunk bottleneck, exact.** The largest chunk load is the minimum over all
   partitions. Costs are converted to integers exactly (every float is a dyadic
   rational; all are scaled by their largest power-of-two denominator), so the search
   compares exact sums and never misses the optimum by a rounding error. The search is
   a bisection over the bottleneck value whose bracket is snapped, after every probe,
   to sums of layers that a partition can achieve; a probe is a greedy sweep that jumps
   chunk by chunk with ``bisect`` on the prefix sums.

   Cost: ``O(L)`` to build the prefix sums, ``O(K log L)`` per probe, at most
   ``bit_length(total)`` probes (10 to 25 measured, L up to 10,000). The textbook
   dynamic program over (stage, layer, layer) is ``O(K L^2)``.

2. **Physical-rank load** (``vpp > 1``, ``balance_ranks=True``). Among the partitions
   whose chunk bottleneck is optimal, the largest per-rank load (sum of the rank's
   chunks) is minimised by a dynamic program over the ``vpp`` chunk boundaries each
   rank step moves, restricted to the window in which each boundary can lie without
   breaking the chunk bottleneck. It is exact when it finishes within
   ``rank_search_budget`` transitions (the real models in docs/pipeline.md need at
   most ~230); otherwise the plan is the best one found by a deterministic local
   search (single-layer boundary moves, from the tie-break partition below), which
   keeps the optimal chunk bottleneck and is never worse than the chunk-only plan but
   is not proven optimal, and the plan says so: ``rank_optimal=False``.

**Tie-break** (deterministic): many partitions usually share the optimum. Let ``T``
be the total load (extras included) and ``P(b)`` the load of the layers before boundary
``b``; boundary ``j`` ideally cuts at ``P = j * T / K``. Each boundary is scored by the
pair ``(|P(b_j) - j * T / K|, b_j)`` and the plan is the optimal partition whose scores,
read in a fixed order, form the lexicographically smallest sequence:

- ``vpp == 1`` or ``balance_ranks=False``: in layer order ``b_1, b_2, ..., b_{K-1}``;
- ``vpp > 1`` with ``balance_ranks=True``: rank step by rank step,
  ``(b_S, b_{2S}, ..., b_{(V-1)S}), (b_1, b_{S+1}, ...), (b_2, b_{S+2}, ...), ...`` with
  ``S = num_stages``, ``V = vpp`` (the order in which the rank search fixes them).

So the slack the bottleneck leaves is spread along the chain rather than piled onto
one end (ties go to the earlier cut). When the rank search
runs out of budget the local search's result is returned as found (still
deterministic), and this rule does not apply.

Outputs for the real systems: :func:`megatron_layout_string` (Megatron-Core's
``pipeline_model_parallel_layout`` grammar, e.g. ``"Et*3|t*4|t*4|t*3L"``) and
:func:`module_names` (per-stage fully qualified module names, torchtitan style).
Bad input raises :class:`~areal_fn.errors.PlanError` naming the value, the rule and a
remedy; there is no silent fallback to another split.

The searches on exact integers live in :mod:`areal_fn.pipeline.exact`, the input
checks in :mod:`areal_fn.pipeline.inputs`.
"""

import bisect
import enum
import itertools
import math
from collections.abc import Sequence

import attrs
import numpy as np

from areal_fn.errors import PlanError
from areal_fn.pipeline.exact import (
    _balanced_boundaries,
    _min_bottleneck,
    _OverBudget,
    _prefix_sums,
    _prefix_sums_open_ends,
    _rank_exact,
    _rank_loads_int,
    _rank_local,
)
from areal_fn.pipeline.inputs import (
    _check_count,
    _check_extra,
    _check_lengths,
    _check_nonempty,
    _check_problem,
    _costs,
    _extra,
    _lengths,
    _validated,
)
from areal_fn.typecheck import beartype

__all__ = [
    "Objective",
    "StagePlan",
    "megatron_layout_string",
    "module_names",
    "partition_pipeline",
    "split_evenly",
]


class Objective(enum.Enum):
    """What a :class:`StagePlan`'s stage lengths were chosen to minimise."""

    #: nothing: the lengths were given (a hand-written or default split).
    GIVEN = "given"
    #: the largest chunk load (with ``vpp == 1`` chunks are ranks).
    CHUNK = "chunk"
    #: the largest chunk load, then, among those partitions, the largest rank load.
    CHUNK_THEN_RANK = "chunk_then_rank"

    def __repr__(self) -> str:
        return f"Objective.{self.name}"


# ----------------------------------------------------------------------------- record


@attrs.frozen(kw_only=True)
class StagePlan:
    """A contiguous split of ``len(costs)`` layers into ``num_stages * vpp`` chunks.

    Fields are the inputs and the decision; loads are derived. ``costs`` are the
    per-layer costs in layer order, ``stage_lengths`` the number of layers of each chunk
    in layer (chunk) order. Chunk ``j`` runs on pipeline rank ``j % num_stages`` as
    virtual stage ``j // num_stages`` (Megatron-Core's interleaving).
    ``rank_optimal`` is True when :attr:`max_rank_load` is proven minimal among the
    partitions with this :attr:`max_load` (always so for ``vpp == 1`` chunk plans).
    """

    costs: tuple[float, ...] = attrs.field(converter=_costs)
    num_stages: int = attrs.field(validator=_check_count)
    vpp: int = attrs.field(default=1, validator=_check_count)
    stage_lengths: tuple[int, ...] = attrs.field(converter=_lengths, validator=_check_lengths)
    first_extra: float = attrs.field(default=0.0, converter=_extra, validator=_check_extra)
    last_extra: float = attrs.field(default=0.0, converter=_extra, validator=_check_extra)
    objective: Objective = attrs.field(
        default=Objective.GIVEN, validator=attrs.validators.instance_of(Objective)
    )
    rank_optimal: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    allow_empty_ends: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )

    def __attrs_post_init__(self) -> None:
        _check_problem(self.costs, self.num_stages, self.vpp, self.allow_empty_ends)
        k = self.num_stages * self.vpp
        if len(self.stage_lengths) != k:
            raise PlanError(
                f"StagePlan has {len(self.stage_lengths)} stage_lengths for num_stages="
                f"{self.num_stages} x vpp={self.vpp} = {k} chunks; give one length per chunk"
            )
        if sum(self.stage_lengths) != len(self.costs):
            raise PlanError(
                f"StagePlan.stage_lengths sum to {sum(self.stage_lengths)} layers but costs "
                f"has {len(self.costs)}; every layer must be in exactly one chunk"
            )
        _check_nonempty(self.stage_lengths, self.allow_empty_ends)
        if self.objective is Objective.GIVEN and self.rank_optimal:
            raise PlanError(
                "StagePlan(objective=Objective.GIVEN, rank_optimal=True): a given split is "
                "not proven optimal; leave rank_optimal=False"
            )

    # -- derived -----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.costs)

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.vpp

    @property
    def boundaries(self) -> tuple[int, ...]:
        """``(0, b_1, ..., L)``: chunk ``j`` holds layers ``b_j .. b_{j+1} - 1``."""
        return (0, *itertools.accumulate(self.stage_lengths))

    @property
    def chunk_ranks(self) -> tuple[int, ...]:
        """Physical pipeline rank of each chunk (``j % num_stages``)."""
        return tuple(j % self.num_stages for j in range(self.num_chunks))

    @property
    def chunk_virtual_stages(self) -> tuple[int, ...]:
        """Virtual stage (Megatron ``vp_stage``) of each chunk (``j // num_stages``)."""
        return tuple(j // self.num_stages for j in range(self.num_chunks))

    def chunk_layers(self, chunk: int) -> range:
        """The layer indices of one chunk."""
        b = self.boundaries
        return range(b[chunk], b[chunk + 1])

    def locate(self, layer: int) -> tuple[int, int, int]:
        """Where decoder layer ``layer`` runs: ``(pp_rank, vp_stage, local index)``, the
        local index counting from the start of its chunk (Megatron's local layer number
        within one model chunk)."""
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < self.num_layers
        ):
            raise PlanError(
                f"layer={layer!r} is outside this plan's {self.num_layers} layers; use "
                f"0..{self.num_layers - 1}"
            )
        b = self.boundaries
        j = bisect.bisect_right(b, layer) - 1
        return j % self.num_stages, j // self.num_stages, layer - b[j]

    def rank_chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks of one physical rank, by virtual stage."""
        return tuple(v * self.num_stages + rank for v in range(self.vpp))

    @property
    def chunk_loads(self) -> tuple[float, ...]:
        """Load of each chunk: its layers' costs plus its extras, summed exactly, then
        rounded once (``math.fsum``)."""
        b = self.boundaries
        k = self.num_chunks
        return tuple(
            math.fsum(
                [*self.costs[b[j] : b[j + 1]]]
                + ([self.first_extra] if j == 0 else [])
                + ([self.last_extra] if j == k - 1 else [])
            )
            for j in range(k)
        )

    @property
    def max_load(self) -> float:
        """The largest chunk load (the pipeline's bottleneck chunk)."""
        return max(self.chunk_loads)

    @property
    def rank_loads(self) -> tuple[float, ...]:
        """Load of each physical rank: the exact sum over its chunks, rounded once."""
        b = self.boundaries
        k = self.num_chunks
        out = []
        for r in range(self.num_stages):
            terms: list[float] = []
            for j in self.rank_chunks(r):
                terms.extend(self.costs[b[j] : b[j + 1]])
                if j == 0:
                    terms.append(self.first_extra)
                if j == k - 1:
                    terms.append(self.last_extra)
            out.append(math.fsum(terms))
        return tuple(out)

    @property
    def max_rank_load(self) -> float:
        """The largest physical-rank load."""
        return max(self.rank_loads)

    def __str__(self) -> str:
        head = (
            f"StagePlan pp={self.num_stages} vpp={self.vpp} layers={self.num_layers} "
            f"objective={self.objective.value}"
            + (" (rank load proven minimal)" if self.rank_optimal else "")
        )
        rows = ["chunk  rank  vstage  layers      n  load"]
        loads = self.chunk_loads
        for j, (n, load) in enumerate(zip(self.stage_lengths, loads, strict=True)):
            lay = self.chunk_layers(j)
            tag = (" +first" if j == 0 and self.first_extra else "") + (
                " +last" if j == self.num_chunks - 1 and self.last_extra else ""
            )
            span = f"{lay.start:4d}-{lay.stop - 1:<4d}" if n else f"{'-':>4} {'':4}"
            rows.append(
                f"{j:5d}  {j % self.num_stages:4d}  {j // self.num_stages:6d}  "
                f"{span} {n:3d}  {load:.6g}{tag}"
            )
        tail = f"max chunk load {self.max_load:.6g}; max rank load {self.max_rank_load:.6g}"
        return "\n".join([head, *rows, tail])


# ----------------------------------------------------------------------------- verbs


@beartype
def partition_pipeline(
    costs: Sequence[float | int] | np.ndarray,
    num_stages: int,
    *,
    vpp: int = 1,
    first_extra: float | int = 0.0,
    last_extra: float | int = 0.0,
    balance_ranks: bool = True,
    rank_search_budget: int = 100_000,
    allow_empty_ends: bool = False,
) -> StagePlan:
    """Cut layers with ``costs`` into ``num_stages * vpp`` contiguous chunks.

    Every chunk holds at least one layer; with ``allow_empty_ends`` the first chunk may
    hold only the embedding (``first_extra``) and the last only the head and loss
    (``last_extra``), as AReaL's partition allows and Megatron-Core's layout expresses
    (``"E|t*4|...|L"``); inner chunks are never empty. The largest chunk load (chunk 0
    with ``first_extra``, the last with ``last_extra``) is the exact minimum over all
    such partitions. With ``vpp > 1`` and ``balance_ranks`` the largest per-rank load is
    then minimised among those partitions, exactly within ``rank_search_budget``
    transitions, else by a local search (``plan.rank_optimal`` tells which). Ties are
    broken as the module docstring says. Raises :class:`PlanError` when the layers
    cannot fill the chunks or a cost is not positive and finite.
    """
    cs, fe, le = _validated(costs, num_stages, vpp, first_extra, last_extra, allow_empty_ends)
    k = num_stages * vpp
    # With open ends the embedding and the head are items of their own (L + 2 items):
    # non-empty chunks of items are exactly the partitions with possibly empty ends.
    prefix = _prefix_sums_open_ends(cs, fe, le) if allow_empty_ends else _prefix_sums(cs, fe, le)
    cap = _min_bottleneck(prefix, k)
    b = _balanced_boundaries(prefix, k, cap)
    objective, rank_optimal = Objective.CHUNK, vpp == 1
    if vpp > 1 and balance_ranks:
        objective = Objective.CHUNK_THEN_RANK
        upper = max(_rank_loads_int(prefix, b, num_stages))
        try:
            exact = _rank_exact(prefix, num_stages, vpp, cap, upper, rank_search_budget)
        except _OverBudget:
            exact = None
        if exact is not None:
            b, rank_optimal = exact, True
        else:
            b = _rank_local(prefix, num_stages, cap, b)
    ends = (0, k - 1) if allow_empty_ends else ()  # the items that are not layers
    return StagePlan(
        costs=cs,
        num_stages=num_stages,
        vpp=vpp,
        stage_lengths=tuple(b[j + 1] - b[j] - ends.count(j) for j in range(k)),
        first_extra=fe,
        last_extra=le,
        objective=objective,
        rank_optimal=rank_optimal,
        allow_empty_ends=allow_empty_ends,
    )


@beartype
def split_evenly(
    costs: Sequence[float | int] | np.ndarray,
    num_stages: int,
    *,
    vpp: int = 1,
    first_extra: float | int = 0.0,
    last_extra: float | int = 0.0,
    account_for_ends: bool = False,
    mtp_layers: int = 0,
) -> StagePlan:
    """The split that ignores costs: every chunk gets ``L // K`` layers and the first
    ``L % K`` chunks one more (Megatron's default when ``K`` divides ``L``).

    ``account_for_ends=True`` counts the embedding and the loss as one layer each, as
    Megatron's ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split`` do: with ``q = (L + 2) // K`` the first and
    the last chunk get ``max(1, q - 1)`` layers and the inner ones ``q``; the layers
    left over go one each to the inner chunks in order, then to the last chunk. So the
    first chunk never holds more layers than another, and when ``K`` divides ``L + 2``
    (and ``q >= 2``) this is exactly Megatron's split under those two flags.
    ``mtp_layers`` (with ``account_for_ends``) count as layers of the last chunk, which
    holds them with the loss, as the published DeepSeek-V3 layouts place the MTP layer
    (``...|mL``): ``q = (L + 2 + mtp_layers) // K`` and the last chunk gets
    ``max(0, q - 1 - mtp_layers)`` decoder layers (possibly none: ``allow_empty_ends``).
    """
    cs, fe, le = _validated(costs, num_stages, vpp, first_extra, last_extra)
    k = num_stages * vpp
    if isinstance(mtp_layers, bool) or mtp_layers < 0:
        raise PlanError(f"mtp_layers={mtp_layers!r} must be an int >= 0")
    if account_for_ends and k > 1:
        q = (len(cs) + 2 + mtp_layers) // k
        last = max(1, q - 1) if not mtp_layers else max(0, q - 1 - mtp_layers)
        lengths = [max(1, q - 1), *(q,) * (k - 2), last]
        for i in range(len(cs) - sum(lengths)):  # fewer than k - 1 when q >= 2, k - 2 else
            lengths[1 + i] += 1
    else:
        q, extra = divmod(len(cs), k)
        lengths = [q + (j < extra) for j in range(k)]
    return StagePlan(
        costs=cs,
        num_stages=num_stages,
        vpp=vpp,
        stage_lengths=tuple(lengths),
        first_extra=fe,
        last_extra=le,
        allow_empty_ends=lengths[-1] == 0,
    )


@beartype
def megatron_layout_string(plan: StagePlan, *, mtp_layers: int = 0) -> str:
    """The plan in Megatron-Core's ``pipeline_model_parallel_layout`` grammar.

    One ``|``-separated entry per chunk in layer order (Megatron reads entry ``j`` as
    pp rank ``j % pp``, vp stage ``j // pp``): ``E`` embedding, ``t`` decoder layer,
    ``L`` loss, ``t*3`` for three layers; an empty first or last chunk is ``E`` or
    ``L`` alone. ``mtp_layers``: multi-token-prediction layers, ``m`` each, in the last
    chunk before ``L`` (where the megatron layout puts them). Pass it as
    ``TransformerConfig(pipeline_model_parallel_layout=...)`` together with
    ``pipeline_model_parallel_size=plan.num_stages``.
    """
    k = plan.num_chunks
    parts = []
    for j, n in enumerate(plan.stage_lengths):
        body = "" if n == 0 else "t" if n == 1 else f"t*{n}"
        end = "m" * mtp_layers + "L" if j == k - 1 else ""
        parts.append(("E" if j == 0 else "") + body + end)
    return "|".join(parts)


@beartype
def module_names(
    plan: StagePlan,
    *,
    embedding: tuple[str, ...] = ("tok_embeddings",),
    layer: str = "layers.{}",
    head: tuple[str, ...] = ("norm", "output"),
) -> tuple[tuple[str, ...], ...]:
    """Fully qualified module names of each chunk, in chunk order (torchtitan style).

    The defaults are torchtitan's names; for a Hugging Face model pass
    ``embedding=("model.embed_tokens",), layer="model.layers.{}",
    head=("model.norm", "lm_head")``. Chunk ``j`` runs on rank ``j % num_stages``
    (torchtitan's "loop" stage order, Megatron's interleaving).
    """
    if layer.format(0) == layer.format(1):
        raise PlanError(
            f"layer={layer!r} does not place the layer index; use a pattern with one "
            "'{}', e.g. 'layers.{}'"
        )
    k = plan.num_chunks
    return tuple(
        (*(embedding if j == 0 else ()), *(layer.format(i) for i in plan.chunk_layers(j)))
        + (head if j == k - 1 else ())
        for j in range(k)
    )
