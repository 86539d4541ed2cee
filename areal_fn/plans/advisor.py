"""`suggest_strategy`: enumerate parallel strategies, keep those that fit, rank them.

**Enumeration** (every strategy uses all ``n_devices``; each is checked by the one
rule (:func:`~areal_fn.strategy.rules.dims_problems`, what
:func:`~areal_fn.strategy.rules.check_dims` raises on) that the layouts and
:func:`~areal_fn.strategy.check.check_strategy` use, and ones it rejects are skipped
and counted):

- ``fsdp:d{dp}t{tp}``: ``dp*tp = n``; ``tp`` at most ``devices_per_node`` (and
  dividing the heads, KV heads, intermediate size and, past two FSDP shards, the
  vocabulary). ``c`` is not enumerated for fsdp: the FSDP2 engine runs it as data
  parallelism today (``dp_shard = dp*cp``), so ``fsdp:d{dp}c{cp}`` is the job
  ``fsdp:d{dp*cp}``; Ulysses sequence parallelism, which fsdp's ``c`` is reserved
  for, is not built yet.
- ``megatron:d{dp}p{pp}t{tp}c{cp}e{ep}v{vpp}``: ``tp`` at most ``devices_per_node``;
  ``pp`` at most 16 and at most the layers; ``vpp`` 1 or 2 (needs ``pp >= 2`` and
  ``2*pp`` layers); ``ep`` (MoE only) divides the experts and ``dp*tp*cp`` (expert
  tensor parallelism left at 1); the rule decides the rest. ``c`` is Megatron-Core's
  context parallelism (parameters replicated over ``cp``, each rank holding
  ``seq_len/cp`` tokens; ring attention needs the TransformerEngine layer spec, which
  is what AReaL builds; this project's CPU ``MegatronEngine`` builds the local spec and
  runs ``cp = 1`` only). Stages: Megatron's even split when ``pp*vpp`` divides the
  layers, else :func:`~areal_fn.pipeline.partition.split_evenly` (first chunks one layer longer).
- Context parallelism ``cp`` (Megatron) keeps at least 4,096 tokens of a sequence per
  rank, at most 8 ways, and ``2*cp`` divides ``seq_len``.

**Fit**: the largest per-rank total of :func:`~areal_fn.plans.memory.estimate_memory` (model
state exact, activations estimated) must be at most ``(1 - memory_margin)`` of
``device_memory_bytes``. Candidates are screened on one rank per pipeline stage (the
rank at coordinate 0 on every other axis: with the divisibility the checks enforce, it
holds the most, since ``torch.chunk`` gives the first shards the larger pieces); the
suggestions returned carry full per-rank reports, and are re-checked against them.

**Score**: estimated seconds per optimizer step (lower is better) of the slowest
pipeline stage: ``m * t_mb + exposed communication + bubble``. Notation: ``B`` global
batch (sequences per step), ``b`` micro-batch size, ``s`` sequence length, ``T = b*s``
tokens per micro-batch, ``m = ceil(B / (dp*b))`` micro-batches per data-parallel
replica, ``h`` hidden size, ``q``/``kv`` query/key-value widths, ``I`` (``I_e``) the
dense (expert) intermediate size, ``E``/``k`` experts and experts per token, ``V``
vocabulary, ``cb`` bytes per activation element, ``L_r``/``M_r`` decoder/MoE layers
of the stage, ``rc`` 1 with recompute else 0. Bytes are what one rank sends per step;
ring collectives over ``g`` ranks send ``(g-1)/g`` of the buffer (reduce-scatter,
all-gather, all-to-all) or twice that (all-reduce).

- ``t_mb``, one micro-batch of the stage's compute, a roofline per part:
  ``max(FLOPs / flops, weight bytes / memory_bandwidth)``. FLOPs per weight and token
  ``6 + 2*rc`` (forward, backward, recomputed forward); weight bytes per element
  ``(2 + rc) * param bytes + 2 * grad bytes`` (reads by forward, backward and
  recompute; gradient accumulation reads and writes). Per layer: attention and dense
  MLP (or router) weights ``(2qh + 2kvh + 3hI)/tp`` on ``T/cp`` tokens plus causal
  attention ``(6 + 2*rc) * s * q / tp`` per token; MoE experts ``3h*I_e`` each, ``k``
  per token, ``E/ep`` of them read (FSDP2 gathers all ``E``; its TP leaves experts
  replicated); the last stage adds the output layer ``V*h/tp``; the input embedding
  (a gather) is left out. Small expert GEMMs come out bound by weight reads, which is
  what expert parallelism relieves.
- bubble: ``(pp - 1) / vpp * t_mb`` of the slowest stage.
- TP (exposed): ``m * L_r * (8 + 4*rc) * (tp-1)/tp * (T/cp) * h * cb`` (per layer two
  all-reduces forward and two backward, or the all-gather/reduce-scatter pairs of
  sequence parallelism, one more forward with recompute).
- CP (exposed): Megatron ring attention ``m * L_r * (3 + rc) * (cp-1) * (T/cp) *
  2*kv/tp * cb`` (K and V passed around the ring forward, again plus their gradients
  backward).
- EP (exposed): ``m * M_r * (4 + 2*rc) * (ep-1)/ep * T/(cp*tp) * k * h * cb`` (token
  dispatch and combine all-to-alls, forward and backward; balanced routing).
- PP (exposed): ``m * 2 * vpp * T/(cp*tp) * h * cb`` (activations forward, their
  gradients backward, at every virtual-stage boundary).
- DP, Megatron (distributed optimizer: gradient reduce-scatter plus parameter
  all-gather, once per step): ``sum over groups (g-1)/g * numel_g * (grad + param
  bytes)`` (:func:`~areal_fn.plans.memory.data_parallel_numels`); overlapped with one
  micro-batch, exposed ``max(0, t_dp - t_mb)``.
- FSDP2 (defaults: parameters re-gathered for backward, gradients reduce-scattered
  every micro-batch): ``m * (g-1) * numel_local * (2*cb + grad bytes)`` over the
  ``g = dp*cp`` shards; overlapped per micro-batch, exposed ``m * max(0, t_fsdp_mb -
  t_mb)``.

A group inside one node (``stride * size <= devices_per_node`` in rank order, tp
fastest) moves at ``intra_node_bandwidth``, else at ``inter_node_bandwidth``.

Defaults (:class:`Hardware`): 8 devices per node, 300 GB/s within a node, 40 GB/s
across nodes, 400 TFLOP/s and 2 TB/s sustained per device. Ties (equal scores) go to
more free memory, then to fewer parallel dimensions, then to the allocation string:
the result is deterministic. Everything here is a model for ranking strategies, not a
prediction of wall time.
"""

import math
from collections.abc import Iterator, Sequence

import attrs

from areal_fn.errors import PlanError, SpecError
from areal_fn.layouts.megatron import stages_for
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.census import Census, CensusIndex, fsdp2_census, megatron_census
from areal_fn.plans.memory import (
    GIB,
    ActivationModel,
    MemoryReport,
    PrecisionPolicy,
    RankMemory,
    estimate_memory,
    estimate_rows,
)
from areal_fn.strategy.allocation import Backend, Component, ParallelDims, divisors
from areal_fn.strategy.rules import dims_problems
from areal_fn.typecheck import beartype

__all__ = ["CommEstimate", "CommTerm", "Hardware", "Suggestion", "suggest_strategy"]

#: Largest pipeline degree tried.
MAX_PP = 16
#: Largest context-parallel degree tried, and the fewest tokens of a sequence per CP rank.
MAX_CP = 8
MIN_TOKENS_PER_CP_RANK = 4096


def _positive(inst: object, attr: "attrs.Attribute[float]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise SpecError(f"{type(inst).__name__}.{attr.name}={value!r} must be a finite number > 0")


def _positive_int(inst: object, attr: "attrs.Attribute[int]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{type(inst).__name__}.{attr.name}={value!r} must be an int >= 1")


@attrs.frozen(kw_only=True)
class Hardware:
    """What the score assumes of a device and its links (defaults: an 8-GPU H100-class
    node: NVLink within the node, one 400 Gb/s NIC per GPU across nodes, about 40% of
    the bf16 peak and 60% of the HBM bandwidth sustained). Bandwidths in bytes/s,
    ``flops`` in FLOP/s."""

    devices_per_node: int = attrs.field(default=8, validator=_positive_int)
    intra_node_bandwidth: float = attrs.field(default=300e9, validator=_positive)
    inter_node_bandwidth: float = attrs.field(default=40e9, validator=_positive)
    flops: float = attrs.field(default=400e12, validator=_positive)
    memory_bandwidth: float = attrs.field(default=2.0e12, validator=_positive)


@attrs.frozen(kw_only=True)
class CommTerm:
    """One kind of communication: bytes one rank sends per step, over ``group`` ranks
    ``intra`` or ``inter`` node, taking ``seconds``, of which ``exposed`` are not hidden."""

    kind: str
    group: int
    link: str
    bytes: int
    seconds: float
    exposed: float

    def __str__(self) -> str:
        hidden = self.seconds - self.exposed
        tail = f", {hidden:.2f} s hidden" if hidden > 5e-3 else ""
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
class Suggestion:
    """One strategy that fits: its allocation string, memory, communication and score
    (estimated seconds per step, lower is better), with the reasons in ``why``."""

    allocation: str
    backend: Backend
    dims: ParallelDims
    memory: MemoryReport
    comm: CommEstimate
    score: float
    why: str

    def __str__(self) -> str:
        return self.why


@attrs.frozen(kw_only=True)
class _Workload:
    model: ModelSpec
    n: int
    policy: PrecisionPolicy
    act: ActivationModel
    batch: int
    hw: Hardware


@attrs.frozen(kw_only=True)
class _Candidate:
    backend: Backend
    dims: ParallelDims
    census: Census
    peak: RankMemory
    comm: CommEstimate

    @property
    def allocation(self) -> str:
        return str(Component(backend=self.backend, dims=self.dims))

    def key(self) -> tuple[object, ...]:
        complexity = sum(
            v > 1 for v in (self.dims.tp, self.dims.pp, self.dims.cp, self.dims.ep, self.dims.vpp)
        )
        return (round(self.comm.step_seconds, 9), self.peak.total, complexity, self.allocation)


# -- enumeration ----------------------------------------------------------------------


def _cp_choices(n: int, seq_len: int) -> list[int]:
    cap = min(MAX_CP, max(1, seq_len // MIN_TOKENS_PER_CP_RANK))
    return [c for c in divisors(n) if c <= cap and (c == 1 or seq_len % (2 * c) == 0)]


def _fsdp_dims(w: _Workload, skipped: list[str]) -> Iterator[ParallelDims]:
    for tp in divisors(w.n):
        if tp > w.hw.devices_per_node:
            continue
        # cp stays 1: the FSDP2 engine runs fsdp's c as data parallelism (fsdp:dXcY is fsdp:d(XY))
        dims = ParallelDims(dp=w.n // tp, tp=tp)
        if dims_problems(w.model, "fsdp2", dims):  # the rule check_dims raises on
            skipped.append(f"fsdp:{dims}")
            continue
        yield dims


def _megatron_dims(w: _Workload, skipped: list[str]) -> Iterator[ParallelDims]:
    m = w.model
    for tp in divisors(w.n):
        if tp > w.hw.devices_per_node:
            continue
        for pp in divisors(w.n // tp):
            if pp > min(MAX_PP, m.num_layers):
                continue
            for cp in _cp_choices(w.n // (tp * pp), w.act.seq_len):
                dp = w.n // (tp * pp * cp)
                eps = [e for e in divisors(m.num_experts) if (dp * tp * cp) % e == 0]
                for vpp in (1, 2) if pp > 1 and 2 * pp <= m.num_layers else (1,):
                    for ep in eps if m.is_moe else [1]:
                        dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)
                        if dims_problems(m, "megatron", dims):
                            skipped.append(f"megatron:{dims}")
                            continue
                        yield dims


def _census(w: _Workload, backend: Backend, dims: ParallelDims) -> Census:
    if backend is Backend.FSDP:
        return fsdp2_census(w.model, dims)
    return megatron_census(w.model, dims, stages=stages_for(w.model, dims))


def _screen(w: _Workload, dims: ParallelDims, census: Census) -> RankMemory:
    """The largest row among one rank per pipeline stage (coordinate 0 elsewhere)."""
    reps = [s * (w.n // dims.pp) for s in range(dims.pp)]
    rows = estimate_rows(census, reps, w.policy, activation=w.act, model=w.model, dims=dims)
    return max(rows, key=lambda r: (r.total, -r.rank))


# -- the score ------------------------------------------------------------------------


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
        moe = model.moe_layers[i]
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


def _estimate(
    w: _Workload,
    backend: Backend,
    dims: ParallelDims,
    index: CensusIndex,
    reps: Sequence[int],
) -> CommEstimate:
    """Compute, bubble and communication of the slowest pipeline stage."""
    model, act, hw, n = w.model, w.act, w.hw, w.n
    cb = DTYPE_BYTES[w.policy.compute_dtype]
    rc = 1 if act.recompute else 0
    m = max(1, -(-w.batch // (dims.dp * act.micro_batch_size)))
    h, hd = model.hidden_size, model.head_dim
    kv = model.num_key_value_heads * hd
    tokens = act.tokens
    tp, cp, ep, pp = dims.tp, dims.cp, dims.ep, dims.pp

    def link(span: int) -> tuple[str, float]:
        if span <= hw.devices_per_node:
            return "intra", hw.intra_node_bandwidth
        return "inter", hw.inter_node_bandwidth

    def term(kind: str, group: int, span: int, nbytes: float, window: float = 0.0) -> CommTerm:
        where, bw = link(span)
        seconds = nbytes / bw
        return CommTerm(
            kind=kind,
            group=group,
            link=where,
            bytes=round(nbytes),
            seconds=seconds,
            exposed=max(0.0, seconds - window),
        )

    stages = []
    for stage, rank in enumerate(reps):
        share = index.share(rank)
        t_mb, bound = _stage_compute(w, backend, dims, share.layers, stage == pp - 1)
        lr = len(share.layers)
        moe_r = sum(model.moe_layers[i] for i in share.layers)
        terms: list[CommTerm] = []
        if tp > 1:
            vol = m * lr * (8 + 4 * rc) * (tp - 1) / tp * tokens / cp * h * cb
            terms.append(term("TP", tp, tp, vol))
        if cp > 1:  # Megatron ring attention (fsdp's c is not enumerated: see the docstring)
            vol = m * lr * (3 + rc) * (cp - 1) * tokens / cp * 2 * kv / tp * cb
            terms.append(term("CP", cp, tp * cp, vol))
        if ep > 1:
            k = model.num_experts_per_tok
            vol = m * moe_r * (4 + 2 * rc) * (ep - 1) / ep * tokens / (cp * tp) * k * h * cb
            terms.append(term("EP", ep, ep * dims.etp, vol))
        if pp > 1:
            terms.append(term("PP", pp, n, m * 2 * dims.vpp * tokens / (cp * tp) * h * cb))
        moved = DTYPE_BYTES[w.policy.grad_dtype] + DTYPE_BYTES[w.policy.param_dtype]
        if backend is Backend.MEGATRON:
            vol = math.fsum((g - 1) / g * numel * moved for g, numel in share.by_dp_group)
            if vol > 0:
                terms.append(term("DP", dims.dp * cp, n // pp, vol, window=t_mb))
        elif dims.dp * cp > 1:
            g = dims.dp * cp
            per_mb = (g - 1) * share.numel * (2 * cb + DTYPE_BYTES[w.policy.grad_dtype])
            one = term("FSDP", g, n, per_mb, window=t_mb)
            terms.append(
                attrs.evolve(
                    one, bytes=m * one.bytes, seconds=m * one.seconds, exposed=m * one.exposed
                )
            )
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


def _why(c: _Candidate, capacity: int, device_memory: int) -> str:
    p, comm = c.peak, c.comm
    free = 1 - p.total / device_memory
    bound = (
        f" ({comm.weight_bound_seconds:.2f} waiting on weight reads)"
        if comm.weight_bound_seconds > 5e-3
        else ""
    )
    where = f" on stage {comm.stage}" if c.dims.pp > 1 else ""
    parts = [f"compute {comm.compute_seconds:.2f}{bound}"]
    if c.dims.pp > 1:
        v = f", vpp {c.dims.vpp}" if c.dims.vpp > 1 else ""
        parts.append(
            f"bubble {comm.bubble_seconds:.2f} (pp {c.dims.pp}, {comm.micro_batches} "
            f"micro-batches{v})"
        )
    parts += [str(t) for t in comm.terms]
    return (
        f"{c.allocation}: peak {p.total / GIB:.1f} GiB on rank {p.rank} of "
        f"{device_memory / GIB:.1f} GiB ({free:.0%} free; params {p.params / GIB:.1f}, grads "
        f"{p.grads / GIB:.1f}, optim {p.optimizer / GIB:.1f}, activ {p.activations / GIB:.1f}, "
        f"buffers {p.buffers / GIB:.1f}); step ~ {comm.step_seconds:.2f} s{where} = "
        + " + ".join(parts)
    )


# -- entry point ----------------------------------------------------------------------

_BF16_MIXED = PrecisionPolicy.bf16_mixed()
_DEFAULT_ACTIVATION = ActivationModel(micro_batch_size=1, seq_len=4096, recompute=True)
_DEFAULT_HARDWARE = Hardware()


def _check_args(
    n_devices: int,
    device_memory_bytes: int,
    backends: Sequence[str],
    top: int,
    global_batch_size: int,
    memory_margin: float,
) -> tuple[Backend, ...]:
    for name, value in (
        ("n_devices", n_devices),
        ("device_memory_bytes", device_memory_bytes),
        ("top", top),
        ("global_batch_size", global_batch_size),
    ):
        if value < 1:
            raise SpecError(f"suggest_strategy: {name}={value} must be >= 1")
    if not 0 <= memory_margin < 1:
        raise SpecError(
            f"suggest_strategy: memory_margin={memory_margin} must be in [0, 1): the fraction "
            f"of device memory kept free"
        )
    if isinstance(backends, str):
        backends = (backends,)
    if not backends:
        raise SpecError("suggest_strategy: backends is empty; pass ('fsdp', 'megatron') or one")
    out = []
    for b in backends:
        if b not in ("fsdp", "megatron"):
            raise SpecError(
                f"suggest_strategy: backend {b!r} is not a training backend; use 'fsdp' and/or "
                f"'megatron'"
            )
        if Backend(b) not in out:
            out.append(Backend(b))
    return tuple(out)


@beartype
def suggest_strategy(
    model: ModelSpec,
    n_devices: int,
    device_memory_bytes: int,
    *,
    policy: PrecisionPolicy = _BF16_MIXED,
    activation: ActivationModel = _DEFAULT_ACTIVATION,
    backends: Sequence[str] = ("fsdp", "megatron"),
    top: int = 10,
    global_batch_size: int = 256,
    memory_margin: float = 0.1,
    hardware: Hardware = _DEFAULT_HARDWARE,
) -> tuple[Suggestion, ...]:
    """The best ``top`` training strategies for ``model`` on ``n_devices`` devices of
    ``device_memory_bytes`` each, best first (see the module docstring for the search,
    the fit rule and the score).

    ``global_batch_size``: sequences per optimizer step (sets the micro-batches per
    replica, hence the bubble and the per-step communication). Raises
    :class:`~areal_fn.errors.PlanError` naming what was tried when nothing fits.
    """
    chosen = _check_args(
        n_devices, device_memory_bytes, backends, top, global_batch_size, memory_margin
    )
    w = _Workload(
        model=model,
        n=n_devices,
        policy=policy,
        act=activation,
        batch=global_batch_size,
        hw=hardware,
    )
    capacity = math.floor(device_memory_bytes * (1 - memory_margin))
    skipped: list[str] = []
    fitting: list[_Candidate] = []
    tried: dict[Backend, int] = {}
    smallest: tuple[int, str] | None = None
    for backend in chosen:
        gen = _fsdp_dims(w, skipped) if backend is Backend.FSDP else _megatron_dims(w, skipped)
        for dims in gen:
            label = str(Component(backend=backend, dims=dims))
            try:
                census = _census(w, backend, dims)
            except SpecError:  # a rule only the full layout checks (e.g. uneven FSDP2+TP rows)
                skipped.append(label)
                continue
            tried[backend] = tried.get(backend, 0) + 1
            peak = _screen(w, dims, census)
            if smallest is None or (peak.total, label) < smallest:
                smallest = (peak.total, label)
            if peak.total > capacity:
                continue
            reps = [s * (w.n // dims.pp) for s in range(dims.pp)]
            comm = _estimate(w, backend, dims, CensusIndex(census), reps)
            fitting.append(
                _Candidate(backend=backend, dims=dims, census=census, peak=peak, comm=comm)
            )
    fitting.sort(key=lambda c: c.key())
    out: list[Suggestion] = []
    for c in fitting:
        if len(out) == top:
            break
        report = estimate_memory(c.census, policy, activation=activation, model=model, dims=c.dims)
        if report.max_total > capacity:
            continue
        c = attrs.evolve(c, peak=report.max_rank)
        out.append(
            Suggestion(
                allocation=c.allocation,
                backend=c.backend,
                dims=c.dims,
                memory=report,
                comm=c.comm,
                score=c.comm.step_seconds,
                why=_why(c, capacity, device_memory_bytes),
            )
        )
    if not out:
        raise PlanError(_nothing_fits(w, chosen, tried, skipped, smallest, device_memory_bytes))
    return tuple(out)


def _nothing_fits(
    w: _Workload,
    chosen: tuple[Backend, ...],
    tried: dict[Backend, int],
    skipped: list[str],
    smallest: tuple[int, str] | None,
    device_memory: int,
) -> str:
    counts = ", ".join(f"{b.value} {tried.get(b, 0)}" for b in chosen)
    best = (
        f"; the smallest peak is {smallest[0] / GIB:.1f} GiB ({smallest[1]})"
        if smallest is not None
        else ""
    )
    skip = f" ({len(skipped)} more rejected by the layout checks)" if skipped else ""
    return (
        f"no strategy for this {w.model.model_type} model ({w.model.num_params / 1e9:.1f}B "
        f"params) on {w.n} devices of {device_memory / GIB:.1f} GiB fits: tried "
        f"{sum(tried.values())} ({counts}){skip}{best}; policy {w.policy}, activations "
        f"{w.act}; use more devices, a lighter policy (PrecisionPolicy.bf16_pure()), "
        f"recompute=True or a smaller micro-batch"
    )
