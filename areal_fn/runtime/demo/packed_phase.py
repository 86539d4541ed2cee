"""Demo stages: training phases on packed mixed-length sequences under SP and CP.

Two phases start from the main trainer's canonical weights and train :data:`STEPS`
steps on the same RL-shaped data: :data:`SEQUENCES` sequences of random lengths in
:data:`LENGTHS` (the affine recurrence of the main task from random starts), a prompt
of :data:`PROMPT` tokens that are not targets, and one loss weight per sequence (an
advantage). The sequences are dealt over two data-parallel shares, and each share
packs its own into rows of at most :data:`BUDGET` tokens (``train_step_packed``):

- :func:`stage_packed_sp`: ``Fsdp2Engine`` under :data:`SP_ALLOCATION` (Ulysses
  sequence parallelism, ``c2`` in each share);
- :func:`stage_packed_cp`: ``MegatronEngine`` under :data:`CP_ALLOCATION` (context
  parallelism, Megatron's load-balanced chunks); its losses must also equal the
  first phase's within :data:`PHASE_ATOL`.

Each phase's first step is checked against plain transformers on one process, each
sequence run on its own, at the tolerances of the gradient-equivalence law
(``tests/distributed/test_grad_equivalence.py``): the loss, the target count, the
gradient norm and every clipped canonical gradient. Forward pre-hooks on the
embedding and on the first attention layer count the tokens each rank ran in that
step: both ranks of a share ran the same rows, each half of every row, and together
the share's tokens plus the rows' padding.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from areal_fn.model.hf_memory import canonical_to_hf_state, hf_state_to_canonical
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import to_hf
from areal_fn.runtime.engines.common import AdamWConfig
from areal_fn.runtime.engines.packed import TokenSequence
from areal_fn.strategy.parse import parse_allocation
from areal_fn.typecheck import beartype

__all__ = [
    "CP_ALLOCATION",
    "SP_ALLOCATION",
    "PhaseData",
    "packed_sequences",
    "reference_step",
    "stage_packed_cp",
    "stage_packed_sp",
]

#: The phase's strategies: Ulysses SP (FSDP2) and context parallelism (Megatron-Core),
#: each ``c2`` inside two data-parallel shares.
SP_ALLOCATION, CP_ALLOCATION = "fsdp:d2c2", "megatron:d2c2"
#: Optimizer steps in the phase; sequences per step (over both shares); their lengths.
STEPS, SEQUENCES, LENGTHS = 3, 12, (6, 48)
#: Tokens a packed row may hold (``max_tokens_per_micro_batch``), a multiple of cp.
BUDGET = 64
#: Leading tokens of every sequence that are not targets (the prompt).
PROMPT = 3
#: The gradient-equivalence law's tolerances (fp32): loss absolute, grad norm and
#: gradients relative (to the largest reference gradient).
LOSS_ATOL, NORM_RTOL, GRAD_RTOL = 1e-5, 1e-5, 1e-5
CLIP = 1.0
#: How far the two engines' losses may be after the same steps from the same weights
#: (each step equals the reference within LOSS_ATOL; AdamW amplifies rounding of
#: near-zero gradients a little from the second step).
PHASE_ATOL = 1e-4

Sample = tuple[Tensor, Tensor, Tensor]  # ids, loss mask, weights (all [n])


@beartype
def packed_sequences(vocab: int, *, seed: int, count: int = SEQUENCES) -> list[Sample]:
    """``count`` sequences of the recurrence ``t' = (5 t + 3) mod vocab`` of random
    lengths in :data:`LENGTHS`, their prompt masked out, one weight per sequence."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(LENGTHS[0], LENGTHS[1] + 1, (1,), generator=g))
        ids = [int(torch.randint(0, vocab, (1,), generator=g))]
        for _ in range(n - 1):
            ids.append((ids[-1] * 5 + 3) % vocab)
        weight = 0.5 + float(torch.rand((), generator=g))
        out.append((torch.tensor(ids), torch.arange(n) >= PROMPT, torch.full((n,), weight)))
    return out


def _plain_model(spec: ModelSpec, canonical: dict[str, Tensor]) -> nn.Module:
    from areal_fn.runtime.engines.fsdp2 import build_hf_model

    model = build_hf_model(spec, seed=0)
    state = {k: v.clone() for k, v in canonical_to_hf_state(canonical, spec).items()}
    model.load_state_dict(state, strict=True)
    return model


@beartype
def reference_step(
    spec: ModelSpec, canonical: dict[str, Tensor], samples: list[Sample]
) -> dict[str, Any]:
    """Plain transformers, one process, each sequence alone: the loss
    ``sum(weight * CE) / targets``, the target count, the gradient norm and the
    gradients clipped to :data:`CLIP` (canonical names)."""
    model = _plain_model(spec, canonical)
    total, count = torch.zeros(()), 0
    for ids, mask, w in samples:
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
        ce = F.cross_entropy(logits, ids[1:], reduction="none")
        total = total + (ce * mask[1:].float() * w[1:]).sum()
        count += int(mask[1:].sum())
    (total / count).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return {
        "loss": float(total.detach()) / count,
        "tokens": count,
        "norm": norm,
        "grads": hf_state_to_canonical(grads, spec),
    }


Seen = list[list[int]]  # tokens per forward: [embedding, first attention layer]


def _hooks(modules: list[tuple[nn.Module, str, int]]) -> tuple[Seen, Callable[[], None]]:
    """Forward pre-hooks recording the tokens (size of dim ``dim`` of the first input,
    positional or the keyword ``name``) of every forward of each ``(module, name, dim)``;
    the second value removes them."""
    seen: Seen = [[] for _ in modules]
    handles = []
    for i, (module, name, dim) in enumerate(modules):

        def hook(
            _m: nn.Module, args: Any, kwargs: Any, i: int = i, name: str = name, dim: int = dim
        ) -> None:
            x = args[0] if args else kwargs[name]
            seen[i].append(int(x.shape[dim]))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return seen, remove


def _fsdp2_hooks(engine: Any) -> tuple[Seen, Callable[[], None]]:
    """The embedding (``[b, s]`` ids) and layer 0's attention (``[b, s, h]``)."""
    m = engine.model
    return _hooks(
        [
            (m.get_submodule(engine.spec.family.outer.embedding_module), "input", 1),
            (m.get_submodule("model.layers.0.self_attn"), "hidden_states", 1),
        ]
    )


def _megatron_hooks(engine: Any) -> tuple[Seen, Callable[[], None]]:
    """The embedding (``[b, s]`` ids) and layer 0's attention (``[s, b, h]``, Megatron's order)."""
    gpt = engine.chunks[0].module
    return _hooks(
        [
            (gpt.embedding, "input_ids", 1),
            (gpt.decoder.layers[0].self_attention, "hidden_states", 0),
        ]
    )


def _canonical_grads(engine: Any) -> dict[str, Tensor]:
    mine = {k: g.detach().cpu().clone() for k, g in engine.local_grads().items() if g is not None}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return to_hf(dict(enumerate(gathered)), engine.layout)


def _tokens_check(
    per_rank: list[Any], shares: dict[int, int], cp: int, max_pad: int
) -> tuple[bool, str]:
    """Every rank ran ``1/cp`` of each of its share's rows, both ranks of a share the
    same rows: together the share's tokens plus under ``max_pad`` padding a row, no
    row over the budget."""
    ok, parts = True, []
    by_share: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for rank, (dp, emb, attn) in enumerate(per_rank):
        by_share.setdefault(dp, []).append((rank, emb, attn))
    for dp, members in sorted(by_share.items()):
        rows = members[0][1]
        ran = sum(rows) * cp
        same = bool(rows) and all(emb == rows and attn == rows for _, emb, attn in members)
        fits = 0 <= ran - shares[dp] < max_pad * len(rows) and max(rows, default=0) * cp <= BUDGET
        ok = ok and len(members) == cp and same and fits
        ranks = "+".join(str(r) for r, _, _ in members)
        parts.append(
            f"ranks {ranks}: {len(rows)} row{'s' * (len(rows) != 1)}, {sum(rows)} tokens each of "
            f"{ran} ({shares[dp]} + {ran - shares[dp]} padding)"
        )
    return ok, "; ".join(parts)


class PhaseData(NamedTuple):
    """What both phases train on: the samples, the one-process reference of their first
    step, and the losses of the phase that ran first (empty before it ran)."""

    samples: list[Sample]
    reference: dict[str, Any]
    losses: list[float]


def _phase(
    engine: Any,
    *,
    label: str,
    what: str,
    cp: int,
    data: PhaseData,
    hooks: Callable[[Any], tuple[Seen, Callable[[], None]]],
    max_pad: int,
    record: Callable[[str, bool, str], None],
    log: Callable[[str], None],
) -> list[float]:
    """:data:`STEPS` packed steps of ``engine`` (``label`` its allocation); records the
    first step against the reference, the tokens per rank and the losses (and, when
    ``data.losses`` holds an earlier phase's, how far they are); returns the losses."""
    samples = data.samples
    mine = [s for i, s in enumerate(samples) if i % engine.dp_size == engine.dp_rank]
    seqs = [TokenSequence(input_ids=a, loss_mask=m, weights=w) for a, m, w in mine]
    seen, remove = hooks(engine)
    losses, first = [], {}
    for step in range(STEPS):
        stats = engine.train_step_packed(seqs, max_tokens_per_micro_batch=BUDGET)
        if step == 0:
            remove()
            first = {"stats": stats, "grads": _canonical_grads(engine)}
        losses.append(float(stats["loss"]))
        log(f"train {label} packed step {step + 1}: loss {losses[-1]:.4f}")
    _record_first_step(first, data.reference, record, what)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (engine.dp_rank, seen[0], seen[1]))
    shares = {
        d: sum(len(s[0]) for i, s in enumerate(samples) if i % engine.dp_size == d)
        for d in range(engine.dp_size)
    }
    ok, figure = _tokens_check(per_rank, shares, cp, max_pad)
    record(
        f"{what} tokens per rank (cp={cp})", ok, f"step 1, each rank half of every row: {figure}"
    )
    lengths = sorted(len(s[0]) for s in samples)
    ok, same = losses[-1] < losses[0], ""
    if data.losses:
        diff = max(abs(a - b) for a, b in zip(losses, data.losses, strict=True))
        ok, same = ok and diff <= PHASE_ATOL, f" (= {SP_ALLOCATION}'s within {diff:.1e})"
    record(
        f"train {label} packed ({what})",
        ok,
        f"{len(samples)} sequences of {lengths[0]}-{lengths[-1]} tokens (prompt {PROMPT} "
        f"masked, weighted) in rows of <= {BUDGET} tokens; loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f} in {STEPS} steps{same}",
    )
    return losses


def stage_packed_sp(
    spec: ModelSpec,
    canonical: dict[str, Tensor],
    optimizer: AdamWConfig,
    record: Callable[[str, bool, str], None],
    log: Callable[[str], None],
) -> PhaseData:
    """The phase under :data:`SP_ALLOCATION` from ``canonical``; returns its data,
    reference and losses (for :func:`stage_packed_cp`)."""
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine

    comp = parse_allocation(SP_ALLOCATION).components[0]
    engine = Fsdp2Engine(spec, comp, optimizer=optimizer, grad_clip=CLIP, seed=0)
    engine.load_canonical(canonical)
    samples = packed_sequences(spec.vocab_size, seed=77)
    data = PhaseData(samples, reference_step(spec, canonical, samples), [])
    losses = _phase(
        engine,
        label=SP_ALLOCATION,
        what="Ulysses SP",
        cp=engine.sp,
        data=data,
        hooks=_fsdp2_hooks,
        max_pad=engine.sp,  # rows padded to a multiple of cp
        record=record,
        log=log,
    )
    return data._replace(losses=losses)


def stage_packed_cp(
    spec: ModelSpec,
    canonical: dict[str, Tensor],
    data: PhaseData,
    optimizer: AdamWConfig,
    record: Callable[[str, bool, str], None],
    log: Callable[[str], None],
) -> None:
    """The same phase under :data:`CP_ALLOCATION` from the same ``canonical`` weights."""
    from areal_fn.runtime.engines.megatron import MegatronEngine

    comp = parse_allocation(CP_ALLOCATION).components[0]
    with MegatronEngine(spec, comp, optimizer=optimizer, grad_clip=CLIP, seed=0) as engine:
        engine.load_canonical(canonical)
        _phase(
            engine,
            label=CP_ALLOCATION,
            what="CP",
            cp=engine.dims.cp,
            data=data,
            hooks=_megatron_hooks,
            max_pad=BUDGET,  # every row of a call padded to the widest
            record=record,
            log=log,
        )


def _record_first_step(
    first: dict[str, Any],
    ref: dict[str, Any],
    record: Callable[[str, bool, str], None],
    what: str,
) -> None:
    stats, grads = first["stats"], first["grads"]
    loss_diff = abs(float(stats["loss"]) - ref["loss"])
    norm_rel = abs(float(stats["grad_norm"]) - ref["norm"]) / ref["norm"]
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    grad_rel = max(float((grads[k] - g).abs().max()) for k, g in ref["grads"].items()) / scale
    same_names = set(grads) == set(ref["grads"])
    record(
        f"packed {what} step = one process, one by one",
        same_names
        and int(stats["tokens"]) == ref["tokens"]
        and loss_diff <= LOSS_ATOL
        and norm_rel <= NORM_RTOL
        and grad_rel <= GRAD_RTOL,
        f"step 1 vs plain transformers: {ref['tokens']} targets; loss |diff| {loss_diff:.1e}, "
        f"grad norm (rel) {norm_rel:.1e}, clipped grads (rel) {grad_rel:.1e} "
        f"(law tolerances 1e-5)",
    )
