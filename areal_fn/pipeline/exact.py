"""The exact core of :func:`~areal_fn.pipeline.partition.partition_pipeline`, on integers.

Costs arrive as exact integer prefix sums (:func:`_prefix_sums`); everything here
compares exact sums. :func:`_min_bottleneck` is the chunk bottleneck (bisection with
snapped brackets, greedy probes), :func:`_balanced_boundaries` the tie-break partition,
:func:`_rank_exact` the physical-rank dynamic program (its steps are the methods of
:class:`_RankSearch`), :func:`_rank_local` the local search used when that runs over
budget. The method and the tie-break rule are in the docstring of
:mod:`areal_fn.pipeline.partition`.
"""

import bisect
import functools
import itertools
import operator
from collections.abc import Iterator, Sequence


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


def _prefix_sums_open_ends(
    costs: tuple[float, ...], first_extra: float, last_extra: float
) -> list[int]:
    """Exact prefix sums of the sequence ``(first_extra, *costs, last_extra)``: the
    embedding and the head are items of their own, so a partition of these ``L + 2``
    items into non-empty chunks is a partition of the layers whose first and last chunk
    may hold no layer (chunk 0 always holds the embedding, the last chunk the head) and
    whose inner chunks hold at least one."""
    return [0, *itertools.accumulate(_scaled([first_extra, *costs, last_extra]))]


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


#: ``layers[r][x]``: for boundaries ``x`` after rank step ``r``, the smallest heaviest
#: rank load that the remaining steps can reach (only values within the bound).
_Layers = list[dict[tuple[int, ...], int]]


class _RankSearch:
    """One :func:`_rank_exact` search: the boundary windows, the greedy reaches (cached)
    and the transitions counted against the budget.

    Rank step ``r`` moves the ``v`` boundaries ``x = (b_r, b_{S+r}, ..)`` to
    ``x' = (b_{r+1}, b_{S+r+1}, ..)`` and puts ``Phi(x') - Phi(x)`` on rank ``r``,
    ``Phi(x) = sum_v prefix[x_v]`` (:meth:`phi`).
    """

    def __init__(self, prefix: list[int], s: int, v: int, cap: int, budget: int) -> None:
        self.prefix, self.s, self.v, self.k = prefix, s, v, s * v
        self.cap, self.budget, self.work = cap, budget, 0
        self.wlo, self.whi = _windows(prefix, self.k, cap)
        self._reach: dict[int, int] = {}

    def far(self, p: int) -> int:
        """:func:`_reach` from ``p``, cached."""
        if p not in self._reach:
            self._reach[p] = _reach(self.prefix, p, self.cap)
        return self._reach[p]

    def phi(self, x: Sequence[int]) -> int:
        return sum(self.prefix[p] for p in x)

    def links(self) -> Iterator[tuple[int, ...]]:
        """Every choice of the pass links ``m = (b_S, .., b_{(V-1)S})`` in their windows."""
        s = self.s
        return itertools.product(
            *(range(self.wlo[i * s], self.whi[i * s] + 1) for i in range(1, self.v))
        )

    def ranges(self, ends: tuple[int, ...]) -> list[list[tuple[int, int]]] | None:
        """Per rank step, the interval each of the ``v`` boundaries can take between the
        pass links ``ends = (0, *m, L)``; None when some interval is empty."""
        s, v = self.s, self.v
        if any(ends[i + 1] - ends[i] < s for i in range(v)):
            return None
        ranges = [[(e, e) for e in ends[:-1]]]
        for r in range(1, s):
            row = []
            for i in range(v):
                lo = max(self.wlo[i * s + r], ends[i] + r)
                hi = min(self.whi[i * s + r], ends[i + 1] - (s - r))
                row.append((lo, hi))
            ranges.append(row)
        ranges.append([(e, e) for e in ends[1:]])
        if any(lo > hi for row in ranges for lo, hi in row):
            return None
        return ranges

    def backward(
        self, ends: tuple[int, ...], ranges: list[list[tuple[int, int]]], upper: int
    ) -> _Layers:
        """The backward min-max dynamic program over the rank steps, pruned to heaviest
        rank loads <= ``upper``."""
        s = self.s
        phi0, phi_end = self.phi(ends[:-1]), self.phi(ends[1:])
        layers: _Layers = [{} for _ in range(s + 1)]
        layers[s][tuple(ends[1:])] = 0
        for r in range(s - 1, -1, -1):
            nxt, here = layers[r + 1], layers[r]
            if not nxt:
                break
            for x in itertools.product(*(range(lo, hi + 1) for lo, hi in ranges[r])):
                succ = self._successors(x, ranges[r + 1])
                if succ is None:
                    continue
                base = self.phi(x)
                if base - phi0 > r * upper or phi_end - base > (s - r) * upper:
                    continue  # the ranks before or after cannot carry that much
                val = self._step(succ, nxt, base, upper)
                if val is not None:
                    here[x] = val
        return layers

    def _successors(
        self, x: tuple[int, ...], nrow: list[tuple[int, int]]
    ) -> list[tuple[int, int]] | None:
        """The intervals the next boundaries can take from ``x`` (None when one is empty)."""
        succ = [(max(x[i] + 1, nrow[i][0]), min(self.far(x[i]), nrow[i][1])) for i in range(self.v)]
        return None if any(lo > hi for lo, hi in succ) else succ

    def _step(
        self,
        succ: list[tuple[int, int]],
        nxt: dict[tuple[int, ...], int],
        base: int,
        upper: int,
    ) -> int | None:
        """The best heaviest rank load through one rank step, from boundaries with
        ``Phi = base`` to ``succ`` and on through ``nxt``; None when it exceeds ``upper``.
        Raises :class:`_OverBudget` past the budget."""
        val = upper + 1
        for y in itertools.product(*(range(lo, hi + 1) for lo, hi in succ)):
            self.work += 1
            g = nxt.get(y)
            if g is None:
                continue
            w = self.phi(y) - base
            val = min(val, max(w, g))
        if self.work > self.budget:
            raise _OverBudget
        return val if val <= upper else None

    def _score(self, r: int, y: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """Tie-break keys of the boundaries ``y`` after rank step ``r``."""
        return tuple(_cut_key(self.prefix, self.k, i * self.s + r + 1, p) for i, p in enumerate(y))

    def path(self, start: tuple[int, ...], layers: _Layers, target: int) -> list[int]:
        """The optimal path from ``start`` with the smallest tie-break keys, read forward,
        as the boundaries ``(0, b_1, ..., L)``."""
        s, k = self.s, self.k
        x = start
        path = [x]
        for r in range(s):
            nxt = layers[r + 1]
            base = self.phi(x)
            x = min(
                (
                    y
                    for y, g in nxt.items()
                    if all(a < c <= self.far(a) for a, c in zip(x, y, strict=True))
                    and max(self.phi(y) - base, g) <= target
                ),
                key=functools.partial(self._score, r),
            )
            path.append(x)
        b = [0] * (k + 1)
        for r, x in enumerate(path):
            for i, p in enumerate(x):
                b[i * s + r] = p
        return b


def _rank_exact(
    prefix: list[int], s: int, v: int, cap: int, upper: int, budget: int
) -> list[int] | None:
    """Exact minimum of the heaviest rank over partitions with chunk loads <= cap.

    For each choice of the pass links ``m = (b_S, .., b_{(V-1)S})``
    (:meth:`_RankSearch.links`) a backward min-max dynamic program over the boundary
    windows (:meth:`_RankSearch.backward`) gives the best rank bottleneck; the optimal
    path with the smallest tie-break keys (see the module docstring of
    :mod:`areal_fn.pipeline.partition`) is then read forward
    (:meth:`_RankSearch.path`). Raises :class:`_OverBudget` after ``budget``
    transitions.
    """
    search = _RankSearch(prefix, s, v, cap, budget)
    k, n = s * v, len(prefix) - 1
    best: tuple[int, tuple[tuple[int, int], ...], tuple[int, ...], _Layers] | None = None
    for m in search.links():
        ends = (0, *m, n)
        ranges = search.ranges(ends)
        if ranges is None:
            continue
        layers = search.backward(ends, ranges, upper)
        start = (0, *m)
        got = layers[0].get(start)
        if got is not None:
            key = tuple(_cut_key(prefix, k, i * s, p) for i, p in enumerate(m, start=1))
            if best is None or (got, key) < best[:2]:
                best = (got, key, start, layers)
                upper = got
    if best is None:  # pragma: no cover - the chunk plan itself is a candidate
        return None
    target, _, start, layers = best
    return search.path(start, layers, target)


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
