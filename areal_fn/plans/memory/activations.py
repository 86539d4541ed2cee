"""Activations and FSDP2 buffers: what :func:`~areal_fn.plans.memory.estimate.estimate_memory` estimates.

:class:`ActivationModel` is one micro-batch; the bytes it makes a rank keep are
estimated from the model's sizes and the parallel degrees (not measured). The exact
part (parameters, gradients, optimizer state) is in :mod:`areal_fn.plans.memory.estimate`.

**Estimated part** (needs ``activation``, ``model`` and ``dims``; an estimate, not a
measurement):

- ``activations``: bytes kept for the backward pass. Per token and decoder layer, in
  ``compute_dtype`` elements: ``4h + 2q + 2kv`` (two norm inputs, the attention and
  MLP inputs, q/k/v after rotary, the attention output) plus ``3I`` for a dense
  SwiGLU MLP (gate, up, activation output) or ``k(2h + 3I_moe)`` for an MoE layer
  (per routed copy: input, gate, up, activation, output); plus fp32 extras: one
  log-sum-exp per head (flash attention keeps no ``s x s`` matrix) and, for MoE, the
  router logits ``E``. ``h`` hidden size, ``q``/``kv`` query/key-value widths
  (heads x head_dim), ``I`` intermediate size, ``k`` experts per token. This plays
  the role of the ``s*b*h*(34 + 5*a*s/h)/t`` of Korthikanti et al. (2022, "Reducing
  Activation Recomputation in Large Transformer Models") for GQA, SwiGLU and MoE
  models with flash attention. A micro-batch of ``T = micro_batch_size * seq_len``
  tokens costs ``ceil(T * per_token / (tp * cp))`` per layer (tensor and sequence
  parallelism split every activation ``tp`` ways, context parallelism splits the
  sequence ``cp`` ways; balanced routing assumed). With ``recompute`` only each
  layer's input is kept (``h`` elements per token) plus one layer's full
  activations, recomputed during the backward pass. The last pipeline stage (every
  FSDP rank) adds the head: final-norm and output-layer inputs (``2h``) and the
  logits in ``compute_dtype`` and fp32 for the loss (``V`` each), split ``tp * cp``
  ways. Multi-token-prediction layers (Megatron's MTP block, on the last stage) count
  as MoE decoder layers, and each adds the embedding of the next tokens, the
  concatenation and the projection (``4h``) and its own logits (``V`` in
  ``compute_dtype`` and fp32). Pipelines keep several micro-batches in flight: stage ``i`` of ``pp`` under
  1F1B holds ``pp - i`` of them; with ``vpp`` virtual stages it holds
  ``2(pp - i - 1) + (vpp - 1) pp + 1`` model chunks of ``1/vpp`` of its layers
  (Megatron's warm-up count plus one), enough micro-batches assumed.
- ``buffers`` (``fsdp2`` layouts with more than one shard): FSDP2's unsharded
  parameters of the two largest units (decoder layers, the embedding, the final norm
  with the output layer: the unit running and the one prefetched) in
  ``compute_dtype``, plus the largest unit's unsharded gradient in ``grad_dtype``,
  over ``tp``.

Everything is integer arithmetic, so estimates are deterministic.
"""

import functools
from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.linear_attention import is_linear_layer
from areal_fn.model.mtp import moe_at
from areal_fn.model.spec import ModelSpec, layer_of
from areal_fn.plans.advisor.census import Census
from areal_fn.strategy.allocation import ParallelDims

__all__ = ["ActivationModel", "in_flight_chunks", "layer_token_bytes"]


def _check_bool(inst: object, attr: "attrs.Attribute[bool]", value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{type(inst).__name__}.{attr.name}={value!r} must be True or False")


def _positive_int(inst: object, attr: "attrs.Attribute[int]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(
            f"{type(inst).__name__}.{attr.name}={value!r} must be an int >= 1; pass e.g. "
            f"{attr.name}=1"
        )


@attrs.frozen(kw_only=True)
class ActivationModel:
    """One micro-batch: ``micro_batch_size`` sequences of ``seq_len`` tokens, and
    whether each layer recomputes its activations in the backward pass (full
    activation checkpointing). See the module docstring for the formula."""

    micro_batch_size: int = attrs.field(validator=_positive_int)
    seq_len: int = attrs.field(validator=_positive_int)
    recompute: bool = attrs.field(default=False, validator=_check_bool)

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    def __str__(self) -> str:
        rc = ", recompute" if self.recompute else ", no recompute"
        return f"micro-batch {self.micro_batch_size} x {self.seq_len} tokens{rc}"


# -- estimated activations and buffers ------------------------------------------------


def layer_token_bytes(model: ModelSpec, moe: bool, compute_bytes: int, linear: bool = False) -> int:
    """Activation bytes one token keeps in one decoder layer (no recompute, no sharding).
    A gated attention output keeps its gate; a gated-delta-net layer (``linear``) keeps
    its projections, the conv and delta-rule outputs, its gated norm's output, and the
    decay and write strength per value head in fp32 (no softmax statistics)."""
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    la = model.linear_attention
    if linear and la is not None:
        qkv = 2 * la.key_dim + la.value_dim
        elems = 3 * h + 2 * qkv + 3 * la.value_dim + 2 * la.value_heads + h
        fp32 = 2 * la.value_heads
    else:
        elems = 4 * h + 2 * q + 2 * kv + (q if la is not None else 0)
        fp32 = model.num_attention_heads
    if moe:
        elems += model.num_experts_per_tok * (2 * h + 3 * model.moe_intermediate_size)
        fp32 += model.num_experts
    else:
        elems += 3 * model.intermediate_size
    return elems * compute_bytes + 4 * fp32


def in_flight_chunks(stage: int, pp: int, vpp: int) -> tuple[int, int]:
    """``(chunks, vpp)``: stage ``stage`` keeps ``chunks`` model chunks of ``1/vpp`` of
    its layers in flight (1F1B: ``pp - stage`` micro-batches of all its layers)."""
    if pp == 1:
        return 1, 1
    if vpp == 1:
        return pp - stage, 1
    return 2 * (pp - stage - 1) + (vpp - 1) * pp + 1, vpp


def _activations(
    model: ModelSpec,
    dims: ParallelDims,
    act: ActivationModel,
    cb: int,
    layers: Sequence[int],
    stage: int,
) -> int:
    """Activation bytes a rank of pipeline stage ``stage`` holding ``layers`` keeps
    (``cb``: bytes per ``compute_dtype`` element)."""
    split = dims.tp * dims.cp
    t = act.tokens

    def per_mb(token_bytes: int) -> int:
        return -(-t * token_bytes // split)

    full = [
        per_mb(layer_token_bytes(model, moe_at(model, i), cb, is_linear_layer(model, i)))
        for i in layers
    ]
    if act.recompute:
        kept = len(layers) * per_mb(model.hidden_size * cb)
        transient = max(full, default=0)
    else:
        kept, transient = sum(full), 0
    chunks, per = in_flight_chunks(stage, dims.pp, dims.vpp)
    total = -(-kept * chunks // per) + transient
    if stage == dims.pp - 1:
        total += per_mb(2 * model.hidden_size * cb + model.vocab_size * (cb + 4))
        mtp = sum(1 for i in layers if i >= model.num_layers)
        total += mtp * per_mb(4 * model.hidden_size * cb + model.vocab_size * (cb + 4))
    return total


@functools.lru_cache(maxsize=16)
def _fsdp_units(model: ModelSpec) -> tuple[int, ...]:
    """Numels of FSDP2 units: each decoder layer, the embedding, the rest of the root."""
    units = [sum(t.numel for t in model.layer_tensors(i)) for i in range(model.num_layers)]
    embed = model.tensor(model.family.outer.embedding).numel
    rest = sum(t.numel for t in model.tensors if layer_of(t.name) is None) - embed
    return (*units, embed, rest)


def _buffers(
    census: Census, model: ModelSpec, dims: ParallelDims, compute_bytes: int, grad_bytes: int
) -> int:
    """FSDP2's unsharded parameters (``compute_bytes`` per element) and gradient
    (``grad_bytes``) in flight on a rank; 0 for other layouts and a single shard."""
    if census.kind != "fsdp2" or census.world_size // dims.tp == 1:
        return 0
    units = sorted(_fsdp_units(model), reverse=True)
    top2 = units[0] + (units[1] if len(units) > 1 else 0)
    params = top2 * compute_bytes
    grads = units[0] * grad_bytes
    return -(-(params + grads) // dims.tp)
