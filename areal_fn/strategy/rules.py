"""The one rule of parallel degrees: which ``ParallelDims`` a layout of a model can hold.

Every path that accepts or refuses degrees calls :func:`check_dims` (the layouts, the
censuses, ``check_strategy`` and so ``areal-fn plan``, the advisor); every remedy comes from
:func:`valid_degrees`: the candidate values of the refused degree filtered through the
same rules, the other degrees held. So a remedy lists only values that are accepted.

Rules by kind (``fsdp2``, ``megatron``, ``inference``, and the engines ``sglang`` and
``vllm``), in the order they are reported:

- degrees a kind cannot express are refused, not ignored: FSDP2 takes ``dp``, ``tp``,
  ``cp`` and ``dp_replicate`` (``pp``, ``ep``, ``etp``, ``vpp`` must be 1); inference
  layouts take ``dp``, ``tp``, ``pp``; ``dp_replicate`` (HSDP) must be 1 outside FSDP2;
  Megatron refuses ``ep`` for a dense model (no experts to split) and,
  as Megatron-Core does, lets ``etp`` (its default is ``tp``) go unused there;
- ``tp`` divides ``num_attention_heads`` (whole heads per rank; all kinds);
- KV heads: Megatron and FSDP2 shard whole KV heads (query groups): ``tp`` divides
  ``num_key_value_heads``; the inference engines also accept a ``tp`` that is a
  multiple of them (each KV head replicated on ``tp/kv`` ranks);
- ``tp`` divides ``intermediate_size`` when the model has dense MLP layers; inference
  also ``moe_intermediate_size`` (the engines split every expert's channels over TP);
- inference: ``tp`` divides the vocabulary padded to ``vocab_multiple`` (64);
  FSDP2 (``tp_embeddings``): ``tp`` divides ``vocab_size`` unless FSDP2 shards over at
  most two ranks (:func:`~areal_fn.layouts.fsdp2.fsdp2_sharding` says why), and so for
  the shared experts' width;
- FSDP2 ``cp`` is Ulysses sequence parallelism (as AReaL's
  ``areal/models/transformers/ulyssess_patch.py``, ``apply_monkey_patch``): ``cp``
  divides the heads of a TP rank, and the KV heads of a TP rank and ``cp`` divide one
  another (KV heads repeated when ``cp`` is a multiple), as the FSDP2 engine's
  attention all-to-all needs;
- Megatron, gated-delta-net families: ``cp`` is 1 (Megatron-Core's ``GatedDeltaNet`` has no
  context parallelism), ``tp`` divides ``linear_num_key_heads`` and the gated shared
  expert's width;
- Megatron: ``tp`` divides the shared experts' width and, for multi-latent attention,
  ``q_lora_rank`` and ``kv_lora_rank + qk_rope_head_dim`` (the local spec shards the
  down projections); ``ep`` divides ``num_experts``, ``etp`` divides ``moe_intermediate_size``,
  ``pp * vpp <= num_layers``; inference: ``pp <= num_layers``; Megatron ``cp`` reads
  no model field (rows of a multiple of ``2 * cp`` tokens are the engine's check,
  :func:`~areal_fn.plans.context.check_context_split`);
- ``sglang`` adds what SGLang's own model code cannot hold (sglang 0.5.23):
  ``LlamaForCausalLM`` with tied embeddings uses ``model.embed_tokens`` as ``lm_head``,
  and ``embed_tokens`` is a ``PPMissingLayer`` off the first pipeline rank
  (``sglang/srt/models/llama.py``), so ``p`` must be 1; ``Qwen3MoeForCausalLM``
  always builds its own ``ParallelLMHead`` and never loads a tied embedding into it
  (``sglang/srt/models/qwen3_moe.py``). ``vllm`` holds what the ``inference`` layout
  says for every supported family;
- before all of them: FSDP2 holds no multi-token-prediction layers
  (:func:`~areal_fn.model.mtp.check_mtp`); Megatron shards each one's ``eh_proj`` rows
  over ``tp``, which must divide ``hidden_size``.

``ep * etp`` dividing ``dp * tp * cp`` is ParallelDims' own check, not a remedy either.
"""

from collections.abc import Iterator
from typing import Literal

import attrs

from areal_fn.errors import LayoutError, SpecError
from areal_fn.model.mtp import check_mtp
from areal_fn.model.spec import ModelSpec
from areal_fn.strategy.allocation import ParallelDims, divisors
from areal_fn.strategy.rules_fixed import (
    _FSDP2_FIXED,
    _INFERENCE_FIXED,
    _MEGATRON_FIXED,
    Problem,
    _fixed,
    _Options,
    _Rule,
)
from areal_fn.strategy.rules_fsdp2 import FSDP2_RULES, linear_key_heads
from areal_fn.typecheck import beartype

__all__ = ["KINDS", "Kind", "Problem", "check_dims", "dims_problems", "valid_degrees"]

#: What the rules are for: a layout kind (``Layout.kind``), or one inference engine (the
#: ``inference`` rules plus what its own model code cannot hold).
Kind = Literal["fsdp2", "megatron", "inference", "sglang", "vllm"]

#: The engines' vocabulary padding (``DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64


def _dense_experts(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    if m.is_moe:
        return None
    if d.ep > 1:
        return Problem(
            field="ep",
            reads=("ep",),
            fixed=True,
            text=f"ep={d.ep} given for dense model {m.model_type} without experts; use ep=1 "
            "(expert parallelism splits experts only)",
        )
    # etp is left alone: Megatron-Core builds dense models under any etp (default tp)
    return None


def _megatron_family(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    """A family Megatron-Core cannot express (its ``megatron_refusal``), at any degrees."""
    why = m.family.megatron_refusal
    return Problem(field="tp", reads=(), fixed=True, text=why) if why else None


def _heads(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    nq = m.num_attention_heads
    if nq % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide num_attention_heads={nq} ({m.model_type}); tensor "
        "parallelism shards whole attention heads",
    )


def _kv_whole(why: str) -> _Rule:
    def check(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
        nkv = m.num_key_value_heads
        if nkv % d.tp == 0:
            return None
        return Problem(
            field="tp",
            reads=("tp",),
            text=f"tp={d.tp} does not divide num_key_value_heads={nkv} ({m.model_type}); {why}",
        )

    return check


def _kv_engines(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    tp, nkv = d.tp, m.num_key_value_heads
    if tp > nkv and tp % nkv:
        text = (
            f"tp={tp} exceeds num_key_value_heads={nkv} but is not a multiple of it; the "
            "engines replicate each KV head on tp/kv ranks"
        )
    elif tp <= nkv and nkv % tp:
        text = (
            f"tp={tp} does not divide num_key_value_heads={nkv} ({m.model_type}); the engines "
            f"shard whole KV heads, or replicate each on tp/kv ranks when tp is a multiple of {nkv}"
        )
    else:
        return None
    return Problem(field="tp", reads=("tp",), text=text)


def _channels(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    inter = m.intermediate_size
    if all(m.moe_layers) or inter % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide intermediate_size={inter} ({m.model_type}); TP shards "
        "whole MLP channels",
    )


def _expert_channels(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    inter = m.moe_intermediate_size
    if not m.is_moe or inter % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide moe_intermediate_size={inter} ({m.model_type}); the "
        "engines split every expert's channels over TP",
    )


def engine_padded_vocab(vocab_size: int, multiple: int = VOCAB_PADDING) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (the engines' ``pad_vocab_size``)."""
    return -(-vocab_size // multiple) * multiple


def _engine_vocab(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    padded = engine_padded_vocab(m.vocab_size, o.vocab_multiple)
    if padded % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide the padded vocabulary {padded} (vocab_size={m.vocab_size} "
        f"padded to a multiple of {o.vocab_multiple}); the engines split the padded vocabulary evenly",
    )


def _latents(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    """Megatron's local-spec MLA shards its down projections over TP (then gathers)."""
    if not m.is_mla:
        return None
    sizes = {"kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim}
    if m.q_lora_rank:
        sizes = {"q_lora_rank": m.q_lora_rank, **sizes}
    bad = {k: v for k, v in sizes.items() if v % d.tp}
    if not bad:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())} "
        f"({m.model_type}); Megatron's multi-latent attention shards its down projections "
        "(linear_q_down_proj, linear_kv_down_proj) over TP",
    )


def _shared_channels(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    width = m.num_shared_experts * m.moe_intermediate_size
    if not width or width % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide the shared experts' width num_shared_experts x "
        f"moe_intermediate_size = {width} ({m.model_type}); Megatron shards the shared "
        "experts' channels over the dense TP group",
    )


def _gated_delta(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    """Megatron-Core's ``GatedDeltaNet`` and gated shared expert (Qwen3-Next, Qwen3.5)."""
    la = m.linear_attention
    if la is not None and d.cp > 1:
        text = (
            f"cp={d.cp}: Megatron-Core 0.16's GatedDeltaNet has no context parallelism "
            f"({m.model_type}'s linear-attention layers; its TransformerConfig asserts "
            "'Gated delta net does not support context parallel for now'); use cp=1"
        )
        return Problem(field="cp", reads=("cp",), text=text, fixed=True)
    if la is not None and la.key_heads % d.tp:
        text = (
            f"tp={d.tp} does not divide linear_num_key_heads={la.key_heads} ({m.model_type}); "
            "Megatron-Core's GatedDeltaNet gives every TP rank whole key heads and their value heads"
        )
        return Problem(field="tp", reads=("tp",), text=text)
    if m.shared_expert_size % d.tp:
        text = (
            f"tp={d.tp} does not divide shared_expert_intermediate_size={m.shared_expert_size} "
            f"({m.model_type}); Megatron shards the gated shared expert's channels over TP"
        )
        return Problem(field="tp", reads=("tp",), text=text)
    return None


def _mtp_projection(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    if not m.mtp_layers or m.hidden_size % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide hidden_size={m.hidden_size} ({m.model_type}, "
        f"{m.mtp_layers} multi-token-prediction layer(s)); Megatron shards the rows of each "
        "MTP layer's eh_proj over TP (a ColumnParallelLinear)",
    )


def _experts(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    if not m.is_moe or m.num_experts % d.ep == 0:
        return None
    return Problem(
        field="ep",
        reads=("ep",),
        text=f"ep={d.ep} does not divide num_experts={m.num_experts} ({m.model_type}); every "
        "expert-parallel rank holds whole experts",
    )


def _expert_tp(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    inter = m.moe_intermediate_size
    if m.has_expert_biases and d.etp > 1:
        text = "Megatron-Core refuses expert tensor parallelism for experts with biases"
        return Problem(
            field="etp",
            reads=("etp",),
            fixed=True,
            text=f"etp={d.etp}: {text} "
            f"({m.model_type}'s experts have them); use etp=1 (ep and tp stay free)",
        )
    if not m.is_moe or inter % d.etp == 0:
        return None
    return Problem(
        field="etp",
        reads=("etp",),
        text=f"etp={d.etp} does not divide moe_intermediate_size={inter} ({m.model_type}); expert "
        "tensor parallelism shards every expert's channels",
    )


def _chunks(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    chunks = d.pp * d.vpp
    if chunks <= m.num_layers:
        return None
    return Problem(
        field="vpp" if d.vpp > 1 else "pp",
        reads=("pp", "vpp"),
        text=f"pp={d.pp} x vpp={d.vpp} = {chunks} pipeline chunks exceed num_layers="
        f"{m.num_layers}; every chunk needs at least one layer",
    )


def _stages(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    if d.pp <= m.num_layers:
        return None
    return Problem(
        field="pp",
        reads=("pp",),
        text=f"pp={d.pp} exceeds num_layers={m.num_layers}; every pipeline stage needs at least "
        "one layer",
    )


def _tied_refusal(engine: str, *, pp_only: bool) -> _Rule:
    """The family's refusal of tied models on ``engine``
    (:attr:`~areal_fn.model.families.serving.Serving.tied_refusals`): those refused at any
    ``pp`` (``pp_only`` false) or only under pipeline parallelism (true)."""

    def rule(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
        if not m.tie_word_embeddings or (pp_only and d.pp == 1):
            return None
        for r in m.family.serving.tied_refusals:
            if r.engine == engine and r.pp_only == pp_only:
                reads = ("pp",) if pp_only else ()
                return Problem(field="pp", reads=reads, fixed=True, text=r.reason.format(pp=d.pp))
        return None

    return rule


_INFERENCE: tuple[_Rule, ...] = (
    *_fixed(_INFERENCE_FIXED),
    _heads,
    _kv_engines,
    linear_key_heads,
    _channels,
    _expert_channels,
    _engine_vocab,
    _stages,
)

_RULES: dict[str, tuple[_Rule, ...]] = {
    "fsdp2": (
        *_fixed(_FSDP2_FIXED),
        _heads,
        _kv_whole("column-wise TP shards whole KV heads"),
        _channels,
        *FSDP2_RULES,
    ),
    "megatron": (
        _megatron_family,
        *_fixed(_MEGATRON_FIXED),
        _dense_experts,
        _heads,
        _kv_whole("Megatron shards whole query groups"),
        _channels,
        _latents,
        _shared_channels,
        _gated_delta,
        _mtp_projection,
        _experts,
        _expert_tp,
        _chunks,
    ),
    "inference": _INFERENCE,
    # sglang 0.5.23, read in its model code; vLLM holds what the inference layout says
    "sglang": (
        _tied_refusal("sglang", pp_only=False),
        *_INFERENCE,
        _tied_refusal("sglang", pp_only=True),
    ),
    "vllm": _INFERENCE,
}

#: Every kind the rules know.
KINDS: tuple[str, ...] = tuple(_RULES)


def _options(vocab_multiple: int, tp_embeddings: bool, hsdp_replicas: int) -> _Options:
    if vocab_multiple < 1:
        raise LayoutError(
            f"vocab_multiple={vocab_multiple} must be >= 1 (64 for SGLang/vLLM, 1 for no padding)"
        )
    return _Options(
        vocab_multiple=vocab_multiple, tp_embeddings=tp_embeddings, hsdp_replicas=hsdp_replicas
    )


def _problems(model: ModelSpec, kind: str, dims: ParallelDims, o: _Options) -> Iterator[Problem]:
    for rule in _RULES[kind]:
        p = rule(model, dims, o)
        if p is not None:
            yield p


@beartype
def dims_problems(
    model: ModelSpec,
    kind: Kind,
    dims: ParallelDims,
    *,
    vocab_multiple: int = VOCAB_PADDING,
    tp_embeddings: bool = True,
    hsdp_replicas: int = 1,
) -> tuple[Problem, ...]:
    """Every rule ``dims`` break for ``model`` in a ``kind`` layout, in report order."""
    o = _options(vocab_multiple, tp_embeddings, hsdp_replicas)
    return tuple(_problems(model, kind, dims, o))


def _candidates(model: ModelSpec, field: str, dims: ParallelDims) -> tuple[int, ...]:
    if field in ("tp", "cp"):
        return divisors(model.num_attention_heads)  # both split the heads
    if field == "ep":
        return divisors(model.num_experts) if model.is_moe else (1,)
    if field == "etp":
        return divisors(model.moe_intermediate_size) if model.is_moe else (1,)
    if field == "pp":
        return tuple(range(1, model.num_layers + 1))
    if field == "vpp":
        return tuple(range(1, model.num_layers // dims.pp + 1)) if dims.pp > 1 else (1,)
    raise LayoutError(f"no rule reads the degree {field!r}; degrees are tp, cp, pp, vpp, ep, etp")


@beartype
def valid_degrees(
    model: ModelSpec,
    kind: Kind,
    dims: ParallelDims,
    field: str,
    *,
    vocab_multiple: int = VOCAB_PADDING,
    tp_embeddings: bool = True,
    hsdp_replicas: int = 1,
) -> tuple[int, ...]:
    """The values ``v`` of degree ``field`` (``tp``, ``cp``, ``pp``, ``vpp``, ``ep``,
    ``etp``) for which ``dims`` with ``field=v`` is a valid ``ParallelDims`` and breaks no
    rule that reads ``field`` (the other degrees held), ascending."""
    o = _options(vocab_multiple, tp_embeddings, hsdp_replicas)
    out = []
    for v in _candidates(model, field, dims):
        try:
            d = attrs.evolve(dims, **{field: v})
        except SpecError:
            continue  # e.g. ep*etp no longer tiles dp*tp*cp
        if not any(field in p.reads for p in _problems(model, kind, d, o)):
            out.append(v)
    return tuple(out)


def _values(vs: tuple[int, ...]) -> str:
    if len(vs) > 5 and vs == tuple(range(vs[0], vs[-1] + 1)):
        return f"{{{vs[0]}, {vs[1]}, ..., {vs[-1]}}}"
    return "{" + ", ".join(str(v) for v in vs) + "}"


@beartype
def check_dims(
    model: ModelSpec,
    kind: Kind,
    dims: ParallelDims,
    *,
    vocab_multiple: int = VOCAB_PADDING,
    tp_embeddings: bool = True,
    hsdp_replicas: int = 1,
) -> None:
    """Raise ``LayoutError`` for the first rule ``dims`` break, with the remedy: the
    values of the refused degree that pass (:func:`valid_degrees`)."""
    check_mtp(mtp_layers=model.mtp_layers, num_layers=model.num_layers, kind=kind)
    o = _options(vocab_multiple, tp_embeddings, hsdp_replicas)
    for p in _problems(model, kind, dims, o):
        if p.fixed:
            raise LayoutError(p.text)
        ok = valid_degrees(
            model,
            kind,
            dims,
            p.field,
            vocab_multiple=vocab_multiple,
            tp_embeddings=tp_embeddings,
            hsdp_replicas=hsdp_replicas,
        )
        remedy = (
            f"use {p.field} in {_values(ok)}"
            if ok
            else f"no {p.field} passes with the other degrees of {dims!r}; change them"
        )
        raise LayoutError(f"{p.text}; {remedy}")
