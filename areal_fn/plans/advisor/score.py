"""The score :func:`~areal_fn.plans.advisor.search.suggest_strategy` ranks strategies by.

Estimated seconds per optimizer step of the slowest pipeline stage: a roofline of each
stage's compute (:func:`_stage_compute`), the pipeline bubble, and the exposed part of
every communication (:class:`CommTerm`: TP, CP, EP, PP, DP or FSDP), on a
:class:`Hardware`. The formulas and their notation are in the docstring of
:mod:`areal_fn.plans.advisor.search`. A model for ranking strategies, not a prediction of
wall time.
"""

import functools
import math
from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.mtp import moe_at
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.advisor.census import CensusIndex, RankShare
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.plans.memory.activations import ActivationModel
from areal_fn.strategy.allocation import Backend, ParallelDims
from areal_fn.typecheck import beartype

__all__ = ["EP_DISPATCHES", "CommEstimate", "CommTerm", "EpSplit", "Hardware", "ep_token_copies"]

#: Token dispatchers the EP term models (:attr:`Hardware.ep_dispatch`): Megatron-Core's
#: default ``alltoall`` (one copy per token and expert) and DeepEP (Megatron's ``flex``
#: dispatcher: one copy per destination rank in the node, one per destination node across).
EP_DISPATCHES = ("alltoall", "deepep")


def _positive(inst: object, attr: "attrs.Attribute[float]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise SpecError(f"{type(inst).__name__}.{attr.name}={value!r} must be a finite number > 0")


def _positive_int(inst: object, attr: "attrs.Attribute[int]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{type(inst).__name__}.{attr.name}={value!r} must be an int >= 1")


def _dispatcher(inst: object, attr: "attrs.Attribute[str]", value: object) -> None:
    if value not in EP_DISPATCHES:
        raise SpecError(
            f"{type(inst).__name__}.{attr.name}={value!r} is not a token dispatcher the score "
            f"models; use one of {', '.join(repr(d) for d in EP_DISPATCHES)}"
        )


@attrs.frozen(kw_only=True)
class Hardware:
    """What the score assumes of a device and its links (defaults: an 8-GPU H100-class
    node: NVLink within the node, one 400 Gb/s NIC per GPU across nodes, about 40% of
    the bf16 peak and 60% of the HBM bandwidth sustained). Bandwidths in bytes/s,
    ``flops`` in FLOP/s. ``ep_dispatch``: the MoE token dispatcher the EP term assumes,
    one of :data:`EP_DISPATCHES` (default ``alltoall``, Megatron-Core's default)."""

    devices_per_node: int = attrs.field(default=8, validator=_positive_int)
    intra_node_bandwidth: float = attrs.field(default=300e9, validator=_positive)
    inter_node_bandwidth: float = attrs.field(default=40e9, validator=_positive)
    flops: float = attrs.field(default=400e12, validator=_positive)
    memory_bandwidth: float = attrs.field(default=2.0e12, validator=_positive)
    ep_dispatch: str = attrs.field(default="alltoall", validator=_dispatcher)


@attrs.frozen(kw_only=True)
class EpSplit:
    """Where the bytes of an EP term go: ``intra_bytes`` over the node's links (to the
    EP peers in the rank's node and, with ``deepep``, the NVLink fan-out the rank relays
    for tokens from other nodes), ``inter_bytes`` across nodes. The EP group lies on
    ``nodes`` nodes, ``per_node`` of its ranks on each (the last may hold fewer)."""

    dispatch: str
    nodes: int
    per_node: int
    intra_bytes: int
    inter_bytes: int


@attrs.frozen(kw_only=True)
class CommTerm:
    """One kind of communication: bytes one rank sends per step, over ``group`` ranks
    ``intra`` or ``inter`` node (``inter`` when any part crosses nodes), taking
    ``seconds``, of which ``exposed`` are not hidden. ``split`` (EP only): the bytes per
    link and the dispatcher assumed."""

    kind: str
    group: int
    link: str
    bytes: int
    seconds: float
    exposed: float
    split: EpSplit | None = None

    def __str__(self) -> str:
        hidden = self.seconds - self.exposed
        tail = f", {hidden:.2f} s hidden" if hidden > 5e-3 else ""
        sp = self.split
        if sp is not None and sp.nodes > 1:
            return (
                f"{self.kind} {self.exposed:.2f} s ({self.bytes / 1e9:.1f} GB/rank over "
                f"{self.group} ranks on {sp.nodes} nodes of {sp.per_node}: "
                f"{sp.intra_bytes / 1e9:.1f} GB in-node, {sp.inter_bytes / 1e9:.1f} GB "
                f"inter-node, {sp.dispatch}{tail})"
            )
        if sp is not None:
            return (
                f"{self.kind} {self.exposed:.2f} s ({self.bytes / 1e9:.1f} GB/rank over "
                f"{self.group} ranks, {self.link}-node, {sp.dispatch}{tail})"
            )
        return (
            f"{self.kind} {self.exposed:.2f} s ({self.bytes / 1e9:.1f} GB/rank over "
            f"{self.group} ranks, {self.link}-node{tail})"
        )


@attrs.frozen(kw_only=True)
class CommEstimate:
    """Compute, bubble and communication of one optimizer step on the slowest pipeline
    stage ``stage``. ``weight_bound_seconds``: the part of ``compute_seconds`` spent
    reading weights beyond the FLOP time (small expert GEMMs)."""

    compute_seconds: float
    weight_bound_seconds: float
    bubble_seconds: float
    micro_batches: int
    stage: int
    terms: tuple[CommTerm, ...]

    @property
    def comm_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def exposed_seconds(self) -> float:
        return math.fsum(t.exposed for t in self.terms)

    @property
    def step_seconds(self) -> float:
        return math.fsum([self.compute_seconds, self.bubble_seconds, self.exposed_seconds])


@attrs.frozen(kw_only=True)
class _Workload:
    model: ModelSpec
    n: int
    policy: PrecisionPolicy
    act: ActivationModel
    batch: int
    hw: Hardware
    offload: bool = False


def _stage_compute(
    w: _Workload, backend: Backend, dims: ParallelDims, layers: Sequence[int], last: bool
) -> tuple[float, float]:
    """Seconds one micro-batch spends in the compute of one pipeline stage, and the part
    of it spent waiting on weight reads rather than on FLOPs (roofline per part)."""
    model, act, hw = w.model, w.act, w.hw
    rc = 1 if act.recompute else 0
    fl = 6 + 2 * rc  # FLOPs per weight per token: forward, backward (x2), recompute
    wb = (2 + rc) * DTYPE_BYTES[w.policy.param_dtype] + 2 * DTYPE_BYTES[w.policy.grad_dtype]
    tokens = act.tokens / dims.cp
    tp = dims.tp
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    attn = 2 * q * h + 2 * kv * h
    total = bound = 0.0

    def part(flops: float, weights: float) -> None:
        nonlocal total, bound
        t_flops, t_bytes = flops / hw.flops, weights * wb / hw.memory_bandwidth
        total += max(t_flops, t_bytes)
        bound += max(0.0, t_bytes - t_flops)

    k, e = model.num_experts_per_tok, model.num_experts
    expert = 3 * h * model.moe_intermediate_size
    for i in layers:
        moe = moe_at(model, i)
        if i >= model.num_layers:  # an MTP layer: eh_proj over tp, and its own logits
            head = model.vocab_size * h / tp
            part(fl * (2 * h * h / tp + head) * tokens, 2 * h * h / tp)
        dense = model.num_experts * h if moe else 3 * h * model.intermediate_size
        core = fl * act.seq_len * q / tp * tokens  # causal attention scores and values
        part(fl * (attn + dense) / tp * tokens + core, (attn + dense) / tp)
        if moe:
            if backend is Backend.MEGATRON:
                part(fl * expert * k * tokens / tp, e // dims.ep * expert)
            else:  # FSDP2 gathers every expert; TP leaves experts replicated
                part(fl * expert * k * tokens, e * expert)
    if last:
        head = model.vocab_size * h / tp
        part(fl * head * tokens, head)
    return total, bound


def _micro_batches(w: _Workload, dims: ParallelDims) -> int:
    """``m = ceil(B / (dp*b))``: micro-batches per data-parallel replica and step."""
    return max(1, -(-w.batch // (dims.dp * w.act.micro_batch_size)))


def _term(
    hw: Hardware, kind: str, group: int, span: int, nbytes: float, window: float = 0.0
) -> CommTerm:
    """``nbytes`` over a group of ``group`` ranks spanning ``span`` consecutive ranks
    (within a node when ``span <= devices_per_node``), hidden behind ``window`` seconds."""
    if span <= hw.devices_per_node:
        where, bw = "intra", hw.intra_node_bandwidth
    else:
        where, bw = "inter", hw.inter_node_bandwidth
    seconds = nbytes / bw
    return CommTerm(
        kind=kind,
        group=group,
        link=where,
        bytes=round(nbytes),
        seconds=seconds,
        exposed=max(0.0, seconds - window),
    )


def _p_miss(experts: int, k: int, groups: int, group_topk: int, lo: int, hi: int) -> float:
    """P(none of a token's ``k`` experts is in ``[lo, hi)``) under balanced uniform routing:
    ``group_topk`` of ``groups`` equal groups drawn uniformly, then ``k`` distinct experts
    uniformly among theirs (one group: ``C(E-x, k) / C(E, k)`` for ``x = hi - lo``). Exact:
    the chance over the groups' total overlap ``X`` with the range (counted over group
    subsets), each term ``C(M-X, k) / C(M, k)`` with ``M`` experts in the kept groups."""
    size = experts // groups
    pool = size * group_topk
    ways: list[dict[int, int]] = [{0: 1}] + [{} for _ in range(group_topk)]
    for g in range(groups):
        c = max(0, min(hi, (g + 1) * size) - max(lo, g * size))
        for t in range(min(g, group_topk - 1), -1, -1):
            for x, n in ways[t].items():
                ways[t + 1][x + c] = ways[t + 1].get(x + c, 0) + n
    miss = sum(n * math.comb(pool - x, k) for x, n in ways[group_topk].items())
    return miss / (math.comb(groups, group_topk) * math.comb(pool, k))


@functools.cache
def _copies(
    experts: int, k: int, groups: int, group_topk: int, ep: int, per_node: int, dispatch: str
) -> tuple[tuple[float, float], ...]:
    per = experts // ep
    nodes = [range(j, min(j + per_node, ep)) for j in range(0, ep, per_node)]
    rank = [1 - _p_miss(experts, k, groups, group_topk, r * per, (r + 1) * per) for r in range(ep)]
    node = [1 - _p_miss(experts, k, groups, group_topk, b[0] * per, b.stop * per) for b in nodes]
    out = []
    for a in range(ep):
        own, loc = a // per_node, a % per_node
        home = nodes[own]
        if dispatch == "alltoall":
            out.append((k * (len(home) - 1) / ep, k * (ep - len(home)) / ep))
            continue
        intra = [rank[r] for r in home if r != a]
        inter = []
        for b, there in enumerate(nodes):
            if b != own:  # one copy to the node's relay, fanned out over NVLink
                inter.append(node[b])
                intra += [rank[r] for r in there if r != there[loc % len(there)]]
        out.append((math.fsum(intra), math.fsum(inter)))
    return tuple(out)


@beartype
def ep_token_copies(
    *,
    experts: int,
    k: int,
    ep: int,
    per_node: int,
    dispatch: str,
    groups: int = 1,
    group_topk: int = 1,
) -> tuple[tuple[float, float], ...]:
    """Expected copies of one token that EP rank ``i`` sends in one all-to-all, as
    ``(over the node's links, across nodes)`` per rank, under balanced uniform routing
    (``experts`` evenly on ``ep`` ranks, ``per_node`` consecutive EP ranks per node, ``k``
    distinct experts per token; group-limited routing: ``group_topk`` of ``groups``
    equal groups first). ``alltoall``: one copy per (token, expert) off the rank.
    ``deepep``: one per distinct destination rank in the node, one per distinct remote
    node (to its relay, the rank at the same local index, modulo a smaller last node),
    plus the NVLink fan-out there: the token's distinct ranks in that node other than the
    relay. The fan-out is counted on the rank whose token causes it: with equal nodes
    the ranks relay, on average, as many copies for others as their own tokens cause.
    Groups are drawn uniformly (balanced routing); the counts are exact expectations
    (``math.comb``)."""
    counts = {"experts": experts, "k": k, "ep": ep, "per_node": per_node}
    counts |= {"groups": groups, "group_topk": group_topk}
    if dispatch not in EP_DISPATCHES:
        problem = f"dispatch={dispatch!r} is not a dispatcher; use one of {EP_DISPATCHES}"
    elif min(counts.values()) < 1:
        bad = ", ".join(f"{n}={v}" for n, v in counts.items() if v < 1)
        problem = f"{bad}: every count must be >= 1"
    elif experts % ep or experts % groups:
        problem = (
            f"ep={ep} and groups={groups} must divide experts={experts} (experts lie evenly "
            f"on the ranks and in the groups); use divisors of {experts}"
        )
    elif per_node > ep:
        problem = f"per_node={per_node} exceeds ep={ep}; use per_node <= ep"
    elif group_topk > groups or k > experts // groups * group_topk:
        problem = (
            f"k={k} experts do not fit in the top group_topk={group_topk} of groups={groups} "
            f"groups of {experts // groups}; use group_topk <= groups and k <= "
            f"{experts // groups} * group_topk"
        )
    else:
        return _copies(experts, k, groups, group_topk, ep, per_node, dispatch)
    raise SpecError(f"ep_token_copies: {problem}")


def _ep_term(w: _Workload, dims: ParallelDims, per_copy: float) -> CommTerm:
    """The EP term: ``per_copy`` bytes per copy of every token, the copies split by
    :func:`ep_token_copies` between the node's links and the network; the two run
    concurrently, so the term takes the longer of the two, on the slowest EP rank."""
    model, hw, ep = w.model, w.hw, dims.ep
    inside = ep * dims.etp <= hw.devices_per_node
    q = ep if inside else max(1, hw.devices_per_node // dims.etp)
    pairs = _copies(
        model.num_experts,
        model.num_experts_per_tok,
        model.router_groups,
        model.router_group_topk,
        ep,
        q,
        hw.ep_dispatch,
    )

    def seconds(pair: tuple[float, float]) -> float:
        intra, inter = pair
        return max(
            intra * per_copy / hw.intra_node_bandwidth, inter * per_copy / hw.inter_node_bandwidth
        )

    worst = max(dict.fromkeys(pairs), key=seconds)
    intra_b, inter_b = round(worst[0] * per_copy), round(worst[1] * per_copy)
    t = seconds(worst)
    split = EpSplit(
        dispatch=hw.ep_dispatch,
        nodes=-(-ep // q),
        per_node=q,
        intra_bytes=intra_b,
        inter_bytes=inter_b,
    )
    link = "intra" if inside else "inter"
    return CommTerm(
        kind="EP", group=ep, link=link, bytes=intra_b + inter_b, seconds=t, exposed=t, split=split
    )


def _stage_terms(
    w: _Workload, backend: Backend, dims: ParallelDims, share: RankShare, t_mb: float
) -> list[CommTerm]:
    """The communication of one pipeline stage whose rank holds ``share`` and spends
    ``t_mb`` seconds computing one micro-batch."""
    model, act, hw, n = w.model, w.act, w.hw, w.n
    cb = DTYPE_BYTES[w.policy.compute_dtype]
    rc = 1 if act.recompute else 0
    m = _micro_batches(w, dims)
    h, kv = model.hidden_size, model.num_key_value_heads * model.head_dim
    tokens = act.tokens
    tp, cp, ep, pp = dims.tp, dims.cp, dims.ep, dims.pp
    lr = len(share.layers)
    moe_r = sum(moe_at(model, i) for i in share.layers)
    terms: list[CommTerm] = []
    if tp > 1:
        vol = m * lr * (8 + 4 * rc) * (tp - 1) / tp * tokens / cp * h * cb
        terms.append(_term(hw, "TP", tp, tp, vol))
    if cp > 1 and backend is Backend.MEGATRON:  # ring attention: K and V around the ring
        vol = m * lr * (3 + rc) * (cp - 1) * tokens / cp * 2 * kv / tp * cb
        terms.append(_term(hw, "CP", cp, tp * cp, vol))
    elif cp > 1:  # Ulysses: q, k, v and the output all-to-all'ed over the cp ranks
        q, hd = model.num_attention_heads * model.head_dim, model.head_dim
        kv_rank = max(kv // tp, cp * hd)  # KV heads repeated up to cp per TP rank
        vol = m * lr * (2 + rc) * (cp - 1) / cp * tokens / cp * (2 * q / tp + 2 * kv_rank) * cb
        terms.append(_term(hw, "SP", cp, tp * cp, vol))
    if ep > 1:
        terms.append(_ep_term(w, dims, m * moe_r * (4 + 2 * rc) * tokens / (cp * tp) * h * cb))
    if pp > 1:
        terms.append(_term(hw, "PP", pp, n, m * 2 * dims.vpp * tokens / (cp * tp) * h * cb))
    moved = DTYPE_BYTES[w.policy.grad_dtype] + DTYPE_BYTES[w.policy.param_dtype]
    if backend is Backend.MEGATRON:
        vol = math.fsum((g - 1) / g * numel * moved for g, numel in share.by_dp_group)
        if vol > 0:
            terms.append(_term(hw, "DP", dims.dp * cp, n // pp, vol, window=t_mb))
    elif dims.dp * cp > 1:
        g = dims.dp * cp
        per_mb = (g - 1) * share.numel * (2 * cb + DTYPE_BYTES[w.policy.grad_dtype])
        one = _term(hw, "FSDP", g, n, per_mb, window=t_mb)
        terms.append(
            attrs.evolve(one, bytes=m * one.bytes, seconds=m * one.seconds, exposed=m * one.exposed)
        )
    return terms


def _estimate(
    w: _Workload,
    backend: Backend,
    dims: ParallelDims,
    index: CensusIndex,
    reps: Sequence[int],
) -> CommEstimate:
    """Compute, bubble and communication of the slowest pipeline stage (``reps``: one
    rank per stage)."""
    m, pp = _micro_batches(w, dims), dims.pp
    stages = []
    for stage, rank in enumerate(reps):
        share = index.share(rank)
        t_mb, bound = _stage_compute(w, backend, dims, share.layers, stage == pp - 1)
        terms = _stage_terms(w, backend, dims, share, t_mb)
        busy = m * t_mb + math.fsum(t.exposed for t in terms)
        stages.append((busy, stage, t_mb, bound, tuple(terms)))
    _, worst, t_worst, bound_worst, terms_worst = max(stages, key=lambda s: (s[0], -s[1]))
    slowest = max(s[2] for s in stages)
    return CommEstimate(
        compute_seconds=m * t_worst,
        weight_bound_seconds=m * bound_worst,
        bubble_seconds=(pp - 1) / dims.vpp * slowest,
        micro_batches=m,
        stage=worst,
        terms=terms_worst,
    )
