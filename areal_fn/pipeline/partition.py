"""Pipeline partition: contiguous layer chunks that minimise the heaviest stage.

A model of ``L`` decoder layers with per-layer costs is cut into ``K = num_stages * vpp``
contiguous, non-empty **chunks** in layer order. With virtual pipeline stages
(``vpp > 1``) the chunks interleave over the physical ranks as Megatron-Core does:
chunk ``j`` lives on pipeline rank ``j % num_stages`` as its virtual stage
``j // num_stages``. Chunk 0 also carries ``first_extra`` (the embedding), chunk
``K - 1`` carries ``last_extra`` (final norm, output head and loss).

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
"""

import bisect
import enum
import itertools
import math
import operator
from collections.abc import Sequence

import attrs
import numpy as np

from areal_fn.errors import PlanError
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


# ----------------------------------------------------------------------------- checks


def _num(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _costs(value: object) -> tuple[float, ...]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise PlanError(
            f"costs={value!r} is not a sequence of per-layer costs; pass one positive "
            "number per decoder layer, in layer order"
        )
    if set(map(type, value)) <= {float}:
        out = tuple(value)
    else:
        for i, c in enumerate(value):
            if not _num(c):
                raise PlanError(
                    f"costs[{i}]={c!r} is not a number; every layer cost must be a float > 0"
                )
        out = tuple(float(c) for c in value)
    if out and not (min(out) > 0.0 and max(out) < math.inf and not any(map(math.isnan, out))):
        i, c = next((i, c) for i, c in enumerate(out) if not 0.0 < c < math.inf)
        raise PlanError(
            f"costs[{i}]={c!r} is not a positive finite number; every layer cost must be "
            "> 0 and finite (a zero or NaN cost makes the balance meaningless); fix the "
            "cost model, or give the layer a small positive cost"
        )
    return out


def _extra(value: object) -> float:
    if not _num(value):
        raise PlanError(f"extra cost {value!r} is not a number; pass a float >= 0")
    return float(value)  # type: ignore[arg-type]


def _check_extra(inst: object, attr: "attrs.Attribute[float]", value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise PlanError(
            f"{attr.name}={value!r} must be finite and >= 0 (it is added to the "
            f"{'first' if attr.name == 'first_extra' else 'last'} chunk's load); pass 0.0 "
            "for no extra cost"
        )


def _check_count(inst: object, attr: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{attr.name}={value!r} must be an int >= 1")


def _check_problem(costs: tuple[float, ...], num_stages: int, vpp: int) -> None:
    if vpp > 1 and num_stages == 1:
        raise PlanError(
            f"vpp={vpp} with num_stages=1: virtual pipeline stages interleave chunks over "
            "several pipeline ranks, so they need num_stages >= 2; use vpp=1, or "
            "num_stages >= 2"
        )
    k = num_stages * vpp
    if not costs:
        raise PlanError(
            "costs is empty: there are no layers to place; give one cost per decoder layer"
        )
    if len(costs) < k:
        fits = [
            f"num_stages={s}, vpp={v}"
            for s in range(1, len(costs) + 1)
            for v in range(1, len(costs) // s + 1)
            if s * v <= len(costs) and (v == 1 or s > 1) and s <= num_stages and v <= vpp
        ]
        hint = f"e.g. {fits[-1]}"
        raise PlanError(
            f"{len(costs)} layers cannot fill num_stages={num_stages} x vpp={vpp} = {k} "
            f"chunks: every chunk needs at least one layer; use num_stages * vpp <= "
            f"{len(costs)} ({hint}), or a model with more layers"
        )


def _lengths(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise PlanError(
            f"StagePlan.stage_lengths={value!r} is not a sequence; give the number of "
            "layers of each chunk, e.g. (3, 4, 4, 3)"
        )
    return tuple(value)


def _check_lengths(inst: object, attr: object, value: tuple[int, ...]) -> None:
    for i, n in enumerate(value):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(
                f"StagePlan.stage_lengths[{i}]={n!r} must be an int >= 1: every chunk holds "
                "at least one layer"
            )


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

    def __attrs_post_init__(self) -> None:
        _check_problem(self.costs, self.num_stages, self.vpp)
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
            rows.append(
                f"{j:5d}  {j % self.num_stages:4d}  {j // self.num_stages:6d}  "
                f"{lay.start:4d}-{lay.stop - 1:<4d} {n:3d}  {load:.6g}{tag}"
            )
        tail = f"max chunk load {self.max_load:.6g}; max rank load {self.max_rank_load:.6g}"
        return "\n".join([head, *rows, tail])


# ----------------------------------------------------------------------------- exact core


def _scaled(values: Sequence[float]) -> list[int]:
    """The values as integers, all multiplied by one power of two: exact for floats."""
    if all(map(float.is_integer, values)):
        return list(map(int, values))
    ratios = [v.as_integer_ratio() for v in values]
    den = max(d for _, d in ratios)
    return [n * (den // d) for n, d in ratios]


def _prefix_sums(costs: tuple[float, ...], first_extra: float, last_extra: float) -> list[int]:
    """Exact prefix sums of the layer costs with the extras folded into the first and
    last layer (every chunk is non-empty, so chunk 0 always holds layer 0 and the last
    chunk always holds layer L-1)."""
    *ints, first, last = _scaled([*costs, first_extra, last_extra])
    ints[0] += first
    ints[-1] += last
    return [0, *itertools.accumulate(ints)]


def _reach(prefix: list[int], start: int, cap: int) -> int:
    """The largest end such that layers ``start .. end-1`` weigh at most ``cap``."""
    return bisect.bisect_right(prefix, prefix[start] + cap) - 1


def _probe(prefix: list[int], k: int, cap: int) -> tuple[bool, int]:
    """Can the layers be cut into at most ``k`` chunks of load <= ``cap``?

    Greedy from the left, each chunk as long as possible. Returns ``(True, worst)``
    with the heaviest greedy chunk (an achievable bottleneck <= cap), or ``(False,
    grow)`` with the smallest cap above ``cap`` under which some greedy chunk would
    grow: every cap below ``grow`` gives the same failing cut.
    """
    n = len(prefix) - 1
    pos, worst = 0, 0
    grow = prefix[n] + 1
    for _ in range(k):
        end = _reach(prefix, pos, cap)
        if end == pos:  # one layer alone is heavier than cap
            return False, prefix[pos + 1] - prefix[pos]
        if end == n:
            return True, max(worst, prefix[n] - prefix[pos])
        worst = max(worst, prefix[end] - prefix[pos])
        grow = min(grow, prefix[end + 1] - prefix[pos])
        pos = end
    return False, grow


def _min_bottleneck(prefix: list[int], k: int) -> int:
    """The exact minimum over partitions into ``k`` non-empty chunks of the heaviest."""
    n = len(prefix) - 1
    heaviest = max(map(operator.sub, prefix[1:], prefix[:-1]))
    lo = max(heaviest, -(-prefix[n] // k))
    hi = prefix[n]
    mid = lo  # the lower bound is often optimal (near-uniform layers): try it first
    while lo < hi:
        ok, snap = _probe(prefix, k, mid)
        if ok:
            hi = snap
        else:
            lo = max(mid + 1, snap)
        mid = (lo + hi) // 2
    return hi


def _suffix_starts(prefix: list[int], k: int, cap: int) -> list[int]:
    """``e[t]``: the earliest layer from which the rest fits in ``t`` chunks <= cap."""
    e = [len(prefix) - 1]
    for _ in range(k):
        e.append(bisect.bisect_left(prefix, prefix[e[-1]] - cap))
    return e


def _prefix_ends(prefix: list[int], k: int, cap: int) -> list[int]:
    """``f[t]``: the latest layer up to which the layers fit in ``t`` chunks <= cap."""
    f = [0]
    for _ in range(k):
        f.append(_reach(prefix, f[-1], cap))
    return f


def _cut_key(prefix: list[int], k: int, j: int, pos: int) -> tuple[int, int]:
    """Tie-break key of boundary ``j`` at ``pos``: the distance of the load before it
    from the ideal ``j * total / k`` (scaled by ``k``), then the position."""
    return abs(k * prefix[pos] - j * prefix[-1]), pos


def _closest(prefix: list[int], k: int, j: int, lo: int, hi: int) -> int:
    """The position in ``lo..hi`` with the smallest :func:`_cut_key` for boundary ``j``."""
    below = bisect.bisect_right(prefix, (j * prefix[-1]) // k) - 1
    cands = {min(max(below, lo), hi), min(max(below + 1, lo), hi)}
    return min(cands, key=lambda p: _cut_key(prefix, k, j, p))


def _balanced_boundaries(prefix: list[int], k: int, cap: int) -> list[int]:
    """Among partitions with bottleneck <= cap, the one whose boundaries, in order, are
    lexicographically closest to the ideal cuts (:func:`_cut_key`).

    Given ``b_{j-1}``, the positions ``b_j`` that extend to a full partition are exactly
    ``max(b_{j-1} + 1, e[k-j]) .. min(reach(b_{j-1}), n - (k - j))``, so choosing the
    best key in that interval, boundary after boundary, is the lexicographic optimum.
    """
    n = len(prefix) - 1
    e = _suffix_starts(prefix, k, cap)
    b = [0]
    for j in range(1, k):
        lo = max(b[-1] + 1, e[k - j])
        hi = min(_reach(prefix, b[-1], cap), n - (k - j))
        b.append(_closest(prefix, k, j, lo, hi))
    b.append(n)
    return b


def _windows(prefix: list[int], k: int, cap: int) -> tuple[list[int], list[int]]:
    """For every boundary ``j``, the interval of positions it can take in a partition
    into ``k`` non-empty chunks of load <= cap (prefix and suffix split independently)."""
    n = len(prefix) - 1
    e = _suffix_starts(prefix, k, cap)
    f = _prefix_ends(prefix, k, cap)
    lo = [max(j, e[k - j]) for j in range(k + 1)]
    hi = [min(n - (k - j), f[j]) for j in range(k + 1)]
    return lo, hi


def _rank_loads_int(prefix: list[int], b: Sequence[int], s: int) -> list[int]:
    loads = [0] * s
    for j in range(len(b) - 1):
        loads[j % s] += prefix[b[j + 1]] - prefix[b[j]]
    return loads


class _OverBudget(Exception):
    pass


def _rank_exact(
    prefix: list[int], s: int, v: int, cap: int, upper: int, budget: int
) -> list[int] | None:
    """Exact minimum of the heaviest rank over partitions with chunk loads <= cap.

    Rank step ``r`` moves the ``v`` boundaries ``x = (b_r, b_{S+r}, ..)`` to
    ``x' = (b_{r+1}, b_{S+r+1}, ..)`` and puts ``Phi(x') - Phi(x)`` on rank ``r``,
    ``Phi(x) = sum_v prefix[x_v]``. For each choice of the pass links
    ``m = (b_S, .., b_{(V-1)S})`` a backward min-max dynamic program over the boundary
    windows gives the best rank bottleneck; the optimal path with the smallest tie-break
    keys (see the module docstring) is then read forward. Raises :class:`_OverBudget`
    after ``budget`` transitions.
    """
    n = len(prefix) - 1
    k = s * v
    wlo, whi = _windows(prefix, k, cap)
    reach: dict[int, int] = {}

    def far(p: int) -> int:
        if p not in reach:
            reach[p] = _reach(prefix, p, cap)
        return reach[p]

    work = 0
    best: (
        tuple[int, tuple[tuple[int, int], ...], tuple[int, ...], list[dict[tuple[int, ...], int]]]
        | None
    ) = None
    links = itertools.product(*(range(wlo[i * s], whi[i * s] + 1) for i in range(1, v)))
    for m in links:
        ends = (0, *m, n)
        if any(ends[i + 1] - ends[i] < s for i in range(v)):
            continue
        ranges = [[(e, e) for e in ends[:-1]]]
        for r in range(1, s):
            row = []
            for i in range(v):
                lo = max(wlo[i * s + r], ends[i] + r)
                hi = min(whi[i * s + r], ends[i + 1] - (s - r))
                row.append((lo, hi))
            ranges.append(row)
        ranges.append([(e, e) for e in ends[1:]])
        if any(lo > hi for row in ranges for lo, hi in row):
            continue
        phi0 = sum(prefix[p] for p in ends[:-1])
        phi_end = sum(prefix[p] for p in ends[1:])
        layers: list[dict[tuple[int, ...], int]] = [{} for _ in range(s + 1)]
        layers[s][tuple(ends[1:])] = 0
        for r in range(s - 1, -1, -1):
            nxt, here = layers[r + 1], layers[r]
            if not nxt:
                break
            nrow = ranges[r + 1]
            for x in itertools.product(*(range(lo, hi + 1) for lo, hi in ranges[r])):
                succ = [(max(x[i] + 1, nrow[i][0]), min(far(x[i]), nrow[i][1])) for i in range(v)]
                if any(lo > hi for lo, hi in succ):
                    continue
                base = sum(prefix[p] for p in x)
                if base - phi0 > r * upper or phi_end - base > (s - r) * upper:
                    continue  # the ranks before or after cannot carry that much
                val = upper + 1
                for y in itertools.product(*(range(lo, hi + 1) for lo, hi in succ)):
                    work += 1
                    g = nxt.get(y)
                    if g is None:
                        continue
                    w = sum(prefix[p] for p in y) - base
                    val = min(val, max(w, g))
                if work > budget:
                    raise _OverBudget
                if val <= upper:
                    here[x] = val
        start = (0, *m)
        got = layers[0].get(start)
        if got is not None:
            key = tuple(_cut_key(prefix, k, i * s, p) for i, p in enumerate(m, start=1))
            if best is None or (got, key) < best[:2]:
                best = (got, key, start, layers)
                upper = got
    if best is None:  # pragma: no cover - the chunk plan itself is a candidate
        return None
    target, _, x, layers = best
    path = [x]
    for r in range(s):
        nxt = layers[r + 1]
        base = sum(prefix[p] for p in x)

        def score(y: tuple[int, ...], r: int = r) -> tuple[tuple[int, int], ...]:
            return tuple(_cut_key(prefix, k, i * s + r + 1, p) for i, p in enumerate(y))

        x = min(
            (
                y
                for y, g in nxt.items()
                if all(a < c <= far(a) for a, c in zip(x, y, strict=True))
                and max(sum(prefix[p] for p in y) - base, g) <= target
            ),
            key=score,
        )
        path.append(x)
    b = [0] * (k + 1)
    for r, x in enumerate(path):
        for i, p in enumerate(x):
            b[i * s + r] = p
    return b


def _rank_local(prefix: list[int], s: int, cap: int, b: list[int]) -> list[int]:
    """Deterministic local search: move one boundary by one layer while that lowers the
    rank loads sorted from the heaviest (lexicographically); keeps chunk loads <= cap."""
    b = list(b)
    k = len(b) - 1
    loads = _rank_loads_int(prefix, b, s)
    key = sorted(loads, reverse=True)
    improved = True
    while improved:
        improved = False
        for j in range(1, k):
            for d in (-1, 1):
                nb = b[j] + d
                if not (b[j - 1] < nb < b[j + 1]):
                    continue
                if prefix[nb] - prefix[b[j - 1]] > cap or prefix[b[j + 1]] - prefix[nb] > cap:
                    continue
                shift = prefix[nb] - prefix[b[j]]
                trial = list(loads)
                trial[(j - 1) % s] += shift
                trial[j % s] -= shift
                tkey = sorted(trial, reverse=True)
                if tkey < key:
                    b[j], loads, key, improved = nb, trial, tkey, True
    return b


# ----------------------------------------------------------------------------- verbs


def _validated(
    costs: object, num_stages: int, vpp: int, first_extra: object, last_extra: object
) -> tuple[tuple[float, ...], float, float]:
    for name, value in (("num_stages", num_stages), ("vpp", vpp)):
        if isinstance(value, bool) or value < 1:
            raise PlanError(f"{name}={value!r} must be an int >= 1")
    cs = _costs(costs)
    fe, le = _extra(first_extra), _extra(last_extra)
    for name, x in (("first_extra", fe), ("last_extra", le)):
        if not (math.isfinite(x) and x >= 0.0):
            raise PlanError(
                f"{name}={x!r} must be finite and >= 0 (it is added to the "
                f"{'first' if name == 'first_extra' else 'last'} chunk's load); pass 0.0 "
                "for no extra cost"
            )
    _check_problem(cs, num_stages, vpp)
    return cs, fe, le


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
) -> StagePlan:
    """Cut layers with ``costs`` into ``num_stages * vpp`` contiguous non-empty chunks.

    The largest chunk load (chunk 0 with ``first_extra``, the last with ``last_extra``)
    is the exact minimum over all such partitions. With ``vpp > 1`` and
    ``balance_ranks`` the largest per-rank load is then minimised among those
    partitions, exactly within ``rank_search_budget`` transitions, else by a local
    search (``plan.rank_optimal`` tells which). Ties are broken as the module docstring
    says. Raises :class:`PlanError` when the layers cannot fill the chunks or a cost is
    not positive and finite.
    """
    cs, fe, le = _validated(costs, num_stages, vpp, first_extra, last_extra)
    k = num_stages * vpp
    prefix = _prefix_sums(cs, fe, le)
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
    return StagePlan(
        costs=cs,
        num_stages=num_stages,
        vpp=vpp,
        stage_lengths=tuple(b[j + 1] - b[j] for j in range(k)),
        first_extra=fe,
        last_extra=le,
        objective=objective,
        rank_optimal=rank_optimal,
    )


@beartype
def split_evenly(
    costs: Sequence[float | int] | np.ndarray,
    num_stages: int,
    *,
    vpp: int = 1,
    first_extra: float | int = 0.0,
    last_extra: float | int = 0.0,
) -> StagePlan:
    """The split that ignores costs: every chunk gets ``L // K`` layers and the first
    ``L % K`` chunks one more (Megatron's default when ``K`` divides ``L``)."""
    cs, fe, le = _validated(costs, num_stages, vpp, first_extra, last_extra)
    k = num_stages * vpp
    q, extra = divmod(len(cs), k)
    return StagePlan(
        costs=cs,
        num_stages=num_stages,
        vpp=vpp,
        stage_lengths=tuple(q + (j < extra) for j in range(k)),
        first_extra=fe,
        last_extra=le,
    )


@beartype
def megatron_layout_string(plan: StagePlan) -> str:
    """The plan in Megatron-Core's ``pipeline_model_parallel_layout`` grammar.

    One ``|``-separated entry per chunk in layer order (Megatron reads entry ``j`` as
    pp rank ``j % pp``, vp stage ``j // pp``): ``E`` embedding, ``t`` decoder layer,
    ``L`` loss, ``t*3`` for three layers. Pass it as
    ``TransformerConfig(pipeline_model_parallel_layout=...)`` together with
    ``pipeline_model_parallel_size=plan.num_stages``.
    """
    k = plan.num_chunks
    parts = []
    for j, n in enumerate(plan.stage_lengths):
        body = "t" if n == 1 else f"t*{n}"
        parts.append(("E" if j == 0 else "") + body + ("L" if j == k - 1 else ""))
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
