"""`suggest_strategy`: enumerate parallel strategies, keep those that fit, rank them.

**Enumeration** (every strategy uses all ``n_devices``; each is checked by the one
rule (:func:`~areal_fn.strategy.rules.dims_problems`, what
:func:`~areal_fn.strategy.rules.check_dims` raises on) that the layouts and
:func:`~areal_fn.strategy.check.check_strategy` use, and ones it rejects are skipped
and counted):

- ``fsdp:d{dp}t{tp}c{cp}``: ``dp*tp*cp = n``; ``tp`` at most ``devices_per_node`` (and
  dividing the heads, KV heads, intermediate size and, past two FSDP shards, the
  vocabulary). ``c`` is the FSDP2 engine's Ulysses sequence parallelism (parameters
  sharded over ``dp*cp``, each rank running ``seq_len/cp`` tokens of every row, the
  attention all-to-all splitting the heads of a TP rank ``cp`` ways).
- ``megatron:d{dp}p{pp}t{tp}c{cp}e{ep}v{vpp}``: ``tp`` at most ``devices_per_node``;
  ``pp`` at most 16 and at most the layers; ``vpp`` 1, 2 or 4 (above 1: needs
  ``pp >= 2`` and ``vpp*pp`` layers); ``ep`` (MoE only) divides the experts and ``dp*tp*cp`` (expert
  tensor parallelism left at 1); the rule decides the rest. ``c`` is Megatron-Core's
  context parallelism (parameters replicated over ``cp``, each rank holding
  ``seq_len/cp`` tokens in Megatron's ``2*cp`` load-balanced chunks). Stages:
  Megatron's even split when ``pp*vpp`` divides the layers, else
  :func:`~areal_fn.layouts.megatron.stages_for`'s split (embedding and loss counted as
  one layer each, so the first and the last chunk hold fewer layers).
- ``cp`` (both backends) keeps at least 4,096 tokens of a sequence per rank, at most 8
  ways, and splits ``seq_len`` as the engine does (:func:`~areal_fn.strategy.rows.check_rows`:
  ``2*cp`` chunks for Megatron, ``cp`` parts for Ulysses).

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
  (a gather) is left out. A multi-token-prediction layer (Megatron's MTP block, on the
  last stage, counted in ``L_r`` and ``M_r``) is an MoE layer plus its ``eh_proj``
  ``2h*h/tp`` and its own logits ``V*h/tp``. Small expert GEMMs come out bound by weight reads, which is
  what expert parallelism relieves.
- bubble: ``(pp - 1) / vpp * t_mb`` of the slowest stage.
- TP (exposed): ``m * L_r * (8 + 4*rc) * (tp-1)/tp * (T/cp) * h * cb`` (per layer two
  all-reduces forward and two backward, or the all-gather/reduce-scatter pairs of
  sequence parallelism, one more forward with recompute).
- CP (exposed): Megatron ring attention ``m * L_r * (3 + rc) * (cp-1) * (T/cp) *
  2*kv/tp * cb`` (K and V passed around the ring forward, again plus their gradients
  backward). Ulysses (fsdp): ``m * L_r * (2 + rc) * (cp-1)/cp * (T/cp) * (2q + 2kv')/tp
  * cb``, ``kv' = max(kv/tp, cp*head_dim) * tp`` (q, k, v and the attention output
  all-to-all'ed forward, their gradients backward, the forward again with recompute;
  KV heads repeated up to ``cp`` per TP rank).
- EP (exposed): ``m * M_r * (4 + 2*rc) * T/(cp*tp) * h * cb`` bytes per copy of a
  token (dispatch and combine all-to-alls, forward and backward, again forward with
  recompute) times the expected copies per token, split between the node's links and
  the network; the two run concurrently, so the term is ``max(intra bytes /
  intra_node_bandwidth, inter bytes / inter_node_bandwidth)`` on the slowest EP rank
  (:func:`~areal_fn.plans.advisor.score.ep_token_copies`). EP ranks are ``etp`` apart:
  ``q = ep`` share a node when ``ep*etp <= devices_per_node``, else ``q =
  devices_per_node // etp``. Copies under balanced uniform routing (``E/ep`` experts per
  rank, ``k`` distinct experts per token; with group-limited routing, ``topk_group``
  of the ``n_group`` groups drawn uniformly first; a set of ``x`` experts gets none of
  the picks with chance ``C(E-x, k)/C(E, k)``, or its average over the kept groups).
  ``Hardware.ep_dispatch``: ``alltoall`` (Megatron-Core's default dispatcher, the
  default): ``k`` copies per token, ``k*(q-1)/ep`` in the node and ``k*(ep-q)/ep``
  across (``k*(ep-1)/ep`` in all); ``deepep`` (DeepEP, Megatron's ``flex``): one copy per
  distinct other rank hit in the node, one per distinct remote node hit (to the rank at
  the same local index there), and the NVLink fan-out each rank relays for the other
  nodes (the distinct ranks a remote token hits in its node, the relay excepted). It
  sends fewer bytes across nodes than ``alltoall``, though it may send more in all.
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
prediction of wall time. The score is computed in :mod:`areal_fn.plans.advisor.score`.
"""

import math
from collections.abc import Iterator, Sequence

import attrs

from areal_fn.errors import PlanError, SpecError
from areal_fn.layouts.megatron import stages_for
from areal_fn.model.lora import LoraConfig
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.advisor.census import Census, CensusIndex, fsdp2_census, megatron_census
from areal_fn.plans.advisor.score import CommEstimate as CommEstimate
from areal_fn.plans.advisor.score import CommTerm as CommTerm
from areal_fn.plans.advisor.score import Hardware as Hardware
from areal_fn.plans.advisor.score import _estimate, _Workload
from areal_fn.plans.memory import (
    GIB,
    ActivationModel,
    MemoryReport,
    PrecisionPolicy,
    RankMemory,
    estimate_memory,
    estimate_rows,
)
from areal_fn.plans.memory.lora import estimate_lora_memory, lora_adapter_census, lora_rows
from areal_fn.plans.precision import engine_policy
from areal_fn.strategy.allocation import Backend, Component, ParallelDims, divisors
from areal_fn.strategy.rules import dims_problems
from areal_fn.typecheck import beartype

__all__ = ["CommEstimate", "CommTerm", "Hardware", "Suggestion", "suggest_strategy"]

#: Largest pipeline degree tried.
MAX_PP = 16
#: Virtual pipeline degrees tried (those above 1 need ``pp >= 2`` and ``vpp * pp`` layers).
VPP_CHOICES = (1, 2, 4)
#: Largest context-parallel degree tried, and the fewest tokens of a sequence per CP rank.
MAX_CP = 8
MIN_TOKENS_PER_CP_RANK = 4096


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
class _Candidate:
    backend: Backend
    dims: ParallelDims
    census: Census
    peak: RankMemory
    comm: CommEstimate
    adapters: Census | None = None  # LoRA's trained adapters (the census is then frozen)

    @property
    def allocation(self) -> str:
        return str(Component(backend=self.backend, dims=self.dims))

    def key(self) -> tuple[object, ...]:
        complexity = sum(
            v > 1 for v in (self.dims.tp, self.dims.pp, self.dims.cp, self.dims.ep, self.dims.vpp)
        )
        return (round(self.comm.step_seconds, 9), self.peak.total, complexity, self.allocation)


# -- enumeration ----------------------------------------------------------------------


def _cp_choices(n: int, seq_len: int, chunks: int) -> list[int]:
    """``cp`` values dividing ``n`` that split ``seq_len`` into ``chunks * cp`` equal
    parts (2 for Megatron's load-balanced chunks, 1 for Ulysses)."""
    cap = min(MAX_CP, max(1, seq_len // MIN_TOKENS_PER_CP_RANK))
    return [c for c in divisors(n) if c <= cap and (c == 1 or seq_len % (chunks * c) == 0)]


def _fsdp_dims(w: _Workload, skipped: list[str]) -> Iterator[ParallelDims]:
    for tp in divisors(w.n):
        if tp > w.hw.devices_per_node:
            continue
        for cp in _cp_choices(w.n // tp, w.act.seq_len, 1):
            dims = ParallelDims(dp=w.n // (tp * cp), tp=tp, cp=cp)
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
            for cp in _cp_choices(w.n // (tp * pp), w.act.seq_len, 2):
                dp = w.n // (tp * pp * cp)
                eps = [e for e in divisors(m.num_experts) if (dp * tp * cp) % e == 0]
                for vpp in [
                    v for v in VPP_CHOICES if v == 1 or (1 < pp and v * pp <= m.num_layers)
                ]:
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


def _screen(
    w: _Workload, dims: ParallelDims, census: Census, adapters: Census | None
) -> RankMemory:
    """The largest row among one rank per pipeline stage (coordinate 0 elsewhere)."""
    reps = [s * (w.n // dims.pp) for s in range(dims.pp)]
    rows = estimate_rows(
        census,
        reps,
        w.policy,
        activation=w.act,
        model=w.model,
        dims=dims,
        optimizer_offload=w.offload,
    )
    if adapters is not None:
        trained = estimate_rows(adapters, reps, w.policy, optimizer_offload=w.offload)
        rows = lora_rows(rows, trained)
    return max(rows, key=lambda r: (r.total, -r.rank))


# -- the reasons ----------------------------------------------------------------------


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
    optimizer_offload: bool = False,
    lora: LoraConfig | None = None,
) -> tuple[Suggestion, ...]:
    """The best ``top`` training strategies for ``model`` on ``n_devices`` devices of
    ``device_memory_bytes`` each, best first (see the module docstring for the search,
    the fit rule and the score).

    ``policy``: counted for each backend as its engine runs it
    (:func:`~areal_fn.plans.precision.engine_policy`: FSDP2 keeps fp32 parameters,
    gradients and Adam states, no master copy). ``global_batch_size``: sequences per
    optimizer step (sets the micro-batches per replica, hence the bubble and the per-step
    communication). ``memory_margin``: the
    fraction of device memory kept free for what the estimate leaves out (CUDA context,
    communication buffers, allocator fragmentation). ``optimizer_offload``: the
    optimizer's master copy and states live in host memory (not counted on the device;
    the time of the offloaded optimizer step is not scored). ``lora``: LoRA training, its
    memory as :func:`~areal_fn.plans.memory.lora.estimate_lora_memory` counts it (a frozen
    base, trained adapters); the score stays that of full training. Raises
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
        offload=optimizer_offload,
    )
    capacity = math.floor(device_memory_bytes * (1 - memory_margin))
    fitting, tried, skipped, smallest = _screened(w, chosen, capacity, lora)
    out = _suggestions(w, fitting, top, capacity, device_memory_bytes)
    if not out:
        raise PlanError(
            _nothing_fits(w, chosen, tried, skipped, smallest, device_memory_bytes)
            + _remedies(w, lora)
        )
    return tuple(out)


def _screened(
    w: _Workload, chosen: tuple[Backend, ...], capacity: int, lora: LoraConfig | None
) -> tuple[list[_Candidate], dict[Backend, int], list[str], tuple[int, str] | None]:
    """Every enumerated strategy screened: those whose screened peak fits ``capacity``
    (with their score), the count tried per backend, the labels the checks rejected,
    and the smallest screened peak with its label."""
    skipped: list[str] = []
    policy = w.policy
    fitting: list[_Candidate] = []
    tried: dict[Backend, int] = {}
    smallest: tuple[int, str] | None = None
    for backend in chosen:
        w = attrs.evolve(w, policy=engine_policy(policy, backend))  # what its engine runs
        gen = _fsdp_dims(w, skipped) if backend is Backend.FSDP else _megatron_dims(w, skipped)
        for dims in gen:
            label = str(Component(backend=backend, dims=dims))
            try:
                census = _census(w, backend, dims)
                comp = Component(backend=backend, dims=dims)
                adapters = None if lora is None else lora_adapter_census(w.model, comp, lora)
            except SpecError:  # a rule only the full layout checks (e.g. uneven FSDP2+TP rows)
                skipped.append(label)
                continue
            tried[backend] = tried.get(backend, 0) + 1
            peak = _screen(w, dims, census, adapters)
            if smallest is None or (peak.total, label) < smallest:
                smallest = (peak.total, label)
            if peak.total > capacity:
                continue
            reps = [s * (w.n // dims.pp) for s in range(dims.pp)]
            comm = _estimate(w, backend, dims, CensusIndex(census), reps)
            fitting.append(
                _Candidate(
                    backend=backend,
                    dims=dims,
                    census=census,
                    peak=peak,
                    comm=comm,
                    adapters=adapters,
                )
            )
    return fitting, tried, skipped, smallest


def _report(w: _Workload, c: _Candidate) -> MemoryReport:
    """The full per-rank report of a candidate (LoRA's when it has adapters)."""
    w = attrs.evolve(w, policy=engine_policy(w.policy, c.backend))
    if c.adapters is not None:
        return estimate_lora_memory(
            c.census,
            c.adapters,
            w.policy,
            activation=w.act,
            model=w.model,
            dims=c.dims,
            optimizer_offload=w.offload,
        )
    return estimate_memory(
        c.census,
        w.policy,
        activation=w.act,
        model=w.model,
        dims=c.dims,
        optimizer_offload=w.offload,
    )


def _suggestions(
    w: _Workload, fitting: list[_Candidate], top: int, capacity: int, device_memory: int
) -> list[Suggestion]:
    """The best ``top`` of ``fitting`` whose full per-rank report still fits ``capacity``."""
    fitting = sorted(fitting, key=lambda c: c.key())
    out: list[Suggestion] = []
    for c in fitting:
        if len(out) == top:
            break
        report = _report(w, c)
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
                why=_why(c, capacity, device_memory),
            )
        )
    return out


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
        f"{w.act}"
    )


def _remedies(w: _Workload, lora: LoraConfig | None) -> str:
    """``; use ...``: what would lower the memory, of what the call did not ask already."""
    p = w.policy
    wide = "float32" in (p.grad_dtype, p.state_dtype) or (
        p.master_weights and p.master_dtype == "float32"
    )
    found = ["more devices"] + (["a lighter policy (PrecisionPolicy.bf16_pure())"] if wide else [])
    found += [] if w.act.recompute else ["recompute=True"]
    found += ["a smaller micro-batch"] if w.act.micro_batch_size > 1 else []
    found += [] if w.offload else ["optimizer_offload=True"]
    found += ["LoRA (lora=LoraConfig(...))"] if lora is None else ["a smaller LoRA rank"]
    return f"; use {', '.join(found[:-1])} or {found[-1]}"
