"""Per-layer cost models for pipeline partitioning, computed from a :class:`ModelSpec`.

A cost model is any function ``ModelSpec -> LayerCosts`` (:data:`CostModel`): bind its
options with ``functools.partial`` and hand it to :func:`partition_model`. Three are
provided:

- :func:`param_costs`: parameters per layer, what AReaL balances (counted from the
  architecture; equal to the canonical tensors' numels);
- :func:`memory_costs`: bytes of parameters with their gradient and optimizer state,
  plus the activations one micro-batch keeps for the backward pass;
- :func:`flop_costs`: training FLOPs (forward + backward) of one micro-batch; the
  attention term grows with the sequence length.

**Which layers are MoE.** By default the spec's own ``moe_layers`` (read from the HF
config, where ``decoder_sparse_step=N`` makes layer ``i`` sparse when
``(i + 1) % N == 0``). A Megatron-Core model configured with ``moe_layer_freq`` builds
other layers: an int ``N`` makes layer ``i`` MoE when ``i % N == 0`` (layers 0, N, 2N,
...); a list gives one 0/1 per layer. Pass ``moe_layer_freq=`` to cost the model
Megatron will build (:func:`megatron_moe_layers`). The two conventions disagree for
every ``N > 1``; mixing them (reading Megatron's ``moe_layer_freq`` with HF's rule) puts
the heavy layers in the wrong places.

**Embedding and head.** ``LayerCosts.embedding`` goes to the first chunk,
``LayerCosts.head`` (final norm, output projection, loss) to the last. With tied
embeddings Megatron still allocates the output weight on the last stage when
``pp > 1``, so the head's parameters are counted either way.

**Multi-token-prediction layers** (a spec with ``mtp_layers``) run in the last chunk,
where Megatron-Core puts its MTP block, so their cost is part of ``head``: per MTP
layer its norms, ``eh_proj`` and decoder layer (routed experts), a second pass through
the output layer, and once the copy of the embedding the block uses on the last stage
(its own ``embed_tokens`` and ``shared_head.head`` are the main model's, tied).
"""

import math
from collections.abc import Callable, Sequence
from typing import TypeAlias

import attrs
import numpy as np

from areal_fn.errors import PlanError
from areal_fn.model.families.mapping import select
from areal_fn.model.linear_attention import is_linear_layer
from areal_fn.model.mtp import moe_at
from areal_fn.model.spec import ModelSpec, condition_flags, dim_sizes
from areal_fn.pipeline.partition import StagePlan, partition_pipeline
from areal_fn.typecheck import beartype

__all__ = [
    "CostModel",
    "LayerCosts",
    "flop_costs",
    "megatron_moe_layers",
    "memory_costs",
    "param_costs",
    "partition_model",
]


def _floats(value: object) -> tuple[float, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise PlanError(f"LayerCosts.layers={value!r} must be a sequence of numbers")
    out = tuple(float(v) for v in value)
    for i, v in enumerate(out):
        if not 0.0 < v < math.inf:
            raise PlanError(
                f"LayerCosts.layers[{i}]={v!r} must be a positive finite number; a layer "
                "always costs something"
            )
    if not out:
        raise PlanError("LayerCosts.layers is empty; give one cost per decoder layer")
    return out


def _check_extra(inst: object, attr: "attrs.Attribute[float]", value: float) -> None:
    if not 0.0 <= value < math.inf:
        raise PlanError(f"LayerCosts.{attr.name}={value!r} must be finite and >= 0")


def _check_unit(inst: object, attr: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise PlanError(f"LayerCosts.unit={value!r} must name the unit, e.g. 'flops'")


@attrs.frozen(kw_only=True)
class LayerCosts:
    """Cost of every decoder layer (layer order) and of the embedding and head."""

    layers: tuple[float, ...] = attrs.field(converter=_floats)
    embedding: float = attrs.field(converter=float, validator=_check_extra)
    head: float = attrs.field(converter=float, validator=_check_extra)
    unit: str = attrs.field(validator=_check_unit)

    @property
    def total(self) -> float:
        return math.fsum((*self.layers, self.embedding, self.head))


#: A cost model: the costs of a model's layers. Bind options with ``functools.partial``.
CostModel: TypeAlias = Callable[[ModelSpec], LayerCosts]


@beartype
def megatron_moe_layers(num_layers: int, moe_layer_freq: int | Sequence[int]) -> tuple[bool, ...]:
    """The layers Megatron-Core builds as MoE for ``moe_layer_freq``.

    An int ``N >= 1``: layer ``i`` is MoE when ``i % N == 0``. A list: one 0/1 (or bool)
    per layer, 1 meaning MoE.
    """
    if isinstance(moe_layer_freq, bool):
        raise PlanError(f"moe_layer_freq={moe_layer_freq!r} must be an int >= 1 or a list of 0/1")
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise PlanError(
                f"moe_layer_freq={moe_layer_freq} must be >= 1 (one MoE layer every N layers, "
                "starting at layer 0); pass a list of 0/1 per layer for other patterns"
            )
        return tuple(i % moe_layer_freq == 0 for i in range(num_layers))
    pattern = tuple(moe_layer_freq)
    if len(pattern) != num_layers or any(p not in (0, 1) for p in pattern):
        raise PlanError(
            f"moe_layer_freq list has {len(pattern)} entries {list(pattern)[:8]}...; it needs "
            f"one 0/1 per layer (num_layers={num_layers}), 1 meaning an MoE layer"
        )
    return tuple(bool(p) for p in pattern)


def _moe_flags(spec: ModelSpec, moe_layer_freq: int | Sequence[int] | None) -> tuple[bool, ...]:
    if moe_layer_freq is None:
        return spec.moe_layers
    if spec.num_experts < 1:
        raise PlanError(
            f"moe_layer_freq={moe_layer_freq!r} given for a dense {spec.model_type} model "
            "(num_experts=0); drop moe_layer_freq or use an MoE model"
        )
    return megatron_moe_layers(spec.num_layers, moe_layer_freq)


def _check_ep(spec: ModelSpec, expert_parallel: int) -> None:
    if expert_parallel < 1:
        raise PlanError(f"expert_parallel={expert_parallel} must be >= 1")
    if spec.num_experts and spec.num_experts % expert_parallel:
        ok = [d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]
        raise PlanError(
            f"expert_parallel={expert_parallel} does not divide num_experts="
            f"{spec.num_experts}; every expert-parallel rank holds the same number of "
            f"experts, use expert_parallel in {ok}"
        )


def _kind_params(
    spec: ModelSpec, moe: bool, expert_parallel: int, linear: bool = False, index: bool = True
) -> int:
    """Parameters of one layer of a kind, from the family's canonical table (routed
    experts divided over ``expert_parallel``; ``linear``: a linear-attention layer;
    ``index``: the layer holds its sparse-attention indexer, if the model has one)."""
    sizes, flags = dim_sizes(spec), condition_flags(spec)
    flags["index_n_heads"] = flags["index_n_heads"] if index else 0
    total = 0
    for r in select(spec.family.canonical, moe=moe, flags=flags, linear=linear):
        numel = math.prod(sizes[d] for d in r.shape)
        total += numel * (spec.num_experts // expert_parallel if r.expert else 1)
    return total


def _layer_params(
    spec: ModelSpec, moe_layer_freq: int | Sequence[int] | None, expert_parallel: int
) -> list[int]:
    _check_ep(spec, expert_parallel)
    kinds = [
        (m, is_linear_layer(spec, i), not spec.indexer_layers or spec.indexer_layers[i])
        for i, m in enumerate(_moe_flags(spec, moe_layer_freq))
    ]
    per_kind = {k: _kind_params(spec, k[0], expert_parallel, k[1], k[2]) for k in set(kinds)}
    return [per_kind[k] for k in kinds]


def _mtp_params(spec: ModelSpec, expert_parallel: int) -> int:
    """Parameters the MTP block adds to the last stage: per MTP layer ``enorm``,
    ``hnorm``, ``eh_proj``, the decoder layer and the final norm, and one copy of the
    embedding (none without MTP layers)."""
    if not spec.mtp_layers:
        return 0
    h = spec.hidden_size
    per = [
        _kind_params(spec, moe_at(spec, i), expert_parallel) + 2 * h * h + 3 * h
        for i in spec.mtp_layer_ids
    ]
    return sum(per) + spec.vocab_size * h


@beartype
def param_costs(
    spec: ModelSpec,
    *,
    moe_layer_freq: int | Sequence[int] | None = None,
    expert_parallel: int = 1,
) -> LayerCosts:
    """Parameters per layer on one pipeline rank (experts divided by ``expert_parallel``).

    Embedding: ``vocab * hidden``; head: final norm plus ``vocab * hidden`` output
    weight (also when tied, see the module docstring), plus the MTP block.
    """
    h, v = spec.hidden_size, spec.vocab_size
    return LayerCosts(
        layers=tuple(float(n) for n in _layer_params(spec, moe_layer_freq, expert_parallel)),
        embedding=float(v * h),
        head=float(v * h + h + _mtp_params(spec, expert_parallel)),
        unit="params",
    )


def _check_tokens(micro_batch_size: int, seq_len: int) -> int:
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
        if value < 1:
            raise PlanError(f"{name}={value} must be >= 1")
    return micro_batch_size * seq_len


def _activation_bytes_per_token(
    spec: ModelSpec, moe: bool, dtype_bytes: float, linear: bool = False
) -> float:
    """Activations one token keeps in one layer for the backward pass (no recomputation,
    flash attention: no sequence-squared term; softmax statistics in fp32). A gated
    attention output keeps its gate; a gated-delta-net layer (``linear``) keeps its
    projections, the conv output, the delta rule's output and its gated norm's, and the
    decay and write strength per value head in fp32."""
    h = spec.hidden_size
    q = spec.num_attention_heads * spec.head_dim
    la = spec.linear_attention
    if linear and la is not None:
        qkv = 2 * la.key_dim + la.value_dim
        elems = 3 * h + (qkv + la.value_dim + 2 * la.value_heads) + qkv + 2 * la.value_dim
        fp32 = 2 * la.value_heads
    else:
        # norm input, qkv input, q/k/v, attention output (o_proj input), second norm input
        elems = h + h + q + spec.k_width + spec.v_width + spec.v_width + h
        elems += q if la is not None else 0  # the output gate (Qwen3-Next, Qwen3.5)
        fp32 = spec.num_attention_heads  # log-sum-exp per head
    if spec.is_mla:  # the query and key/value latents (inputs of their norms and up projections)
        elems += 2 * spec.q_lora_rank + 2 * spec.kv_lora_rank
    if moe:
        k, inter = spec.num_experts_per_tok, spec.moe_intermediate_size
        elems += h + k * (h + 3 * inter + h)  # router input; per routed copy in/gate/up/act/out
        fp32 += spec.num_experts  # router logits
    else:
        elems += h + 3 * spec.intermediate_size  # mlp input; gate, up, down input
    return elems * dtype_bytes + fp32 * 4.0


@beartype
def memory_costs(
    spec: ModelSpec,
    *,
    micro_batch_size: int,
    seq_len: int,
    in_flight: int = 1,
    bytes_per_param: float = 18.0,
    activation_bytes: float = 2.0,
    moe_layer_freq: int | Sequence[int] | None = None,
    expert_parallel: int = 1,
) -> LayerCosts:
    """Bytes per layer: parameters times ``bytes_per_param`` (default 18: bf16 weight,
    fp32 gradient, fp32 master weight and two Adam moments) plus the activations of
    ``in_flight`` micro-batches of ``micro_batch_size x seq_len`` tokens (elements of
    ``activation_bytes`` each). Per pipeline rank before tensor/context parallelism.

    Head activations: final-norm and output inputs plus the logits in bf16 and fp32 for
    the loss, ``vocab`` wide per token (often the largest single activation). Each MTP
    layer adds its decoder layer's activations, the inputs of its two norms and of
    ``eh_proj`` (``4 * hidden``), its final norm's and its logits.
    """
    tokens = _check_tokens(micro_batch_size, seq_len) * in_flight
    if (
        in_flight < 1
        or not 0.0 < bytes_per_param < math.inf
        or not 0.0 < activation_bytes < math.inf
    ):
        raise PlanError(
            f"in_flight={in_flight}, bytes_per_param={bytes_per_param}, activation_bytes="
            f"{activation_bytes}: each must be positive"
        )
    params = _layer_params(spec, moe_layer_freq, expert_parallel)
    flags = _moe_flags(spec, moe_layer_freq)
    layers = tuple(
        p * bytes_per_param
        + tokens * _activation_bytes_per_token(spec, m, activation_bytes, is_linear_layer(spec, i))
        for i, (p, m) in enumerate(zip(params, flags, strict=True))
    )
    h, v = spec.hidden_size, spec.vocab_size
    logits = v * (activation_bytes + 4.0)
    mtp = sum(
        _activation_bytes_per_token(spec, moe_at(spec, i), activation_bytes)
        + 5 * h * activation_bytes
        + logits
        for i in spec.mtp_layer_ids
    )
    return LayerCosts(
        layers=layers,
        embedding=v * h * bytes_per_param + tokens * h * activation_bytes,
        head=(v * h + h + _mtp_params(spec, expert_parallel)) * bytes_per_param
        + tokens * (2 * h * activation_bytes + logits + mtp),
        unit="bytes",
    )


def _attention_weights(spec: ModelSpec) -> int:
    """Elements of layer 0's attention matrices (``self_attn.*`` tensors of rank 2)."""
    return sum(
        t.numel for t in spec.layer_tensors(0) if ".self_attn." in t.name and len(t.shape) == 2
    )


@beartype
def flop_costs(
    spec: ModelSpec,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    causal: bool = True,
    moe_layer_freq: int | Sequence[int] | None = None,
) -> LayerCosts:
    """Training FLOPs (forward + backward = 3 x forward) of one micro-batch per layer.

    Matrix multiplies count 2 FLOPs per multiply-add: the projections, the dense MLP or
    the router plus ``num_experts_per_tok`` experts per token, and attention scores and
    values: ``2 * heads * (head_dim + v_head_dim)`` per (query, key) pair (``4 * heads *
    head_dim`` but for multi-latent attention, whose projections count every latent
    weight once), over ``seq_len * (seq_len +
    1) / 2`` pairs per sequence when ``causal`` (else ``seq_len**2``). Norms, rotary and
    element-wise ops are left out. Embedding: 0 (a gather); head: the output projection,
    and per MTP layer its decoder layer (routed experts), ``eh_proj`` and the output
    projection again. A gated attention's ``q_proj`` is twice as wide (its gate). A
    gated-delta-net layer has no pairs: its projections, the conv (``conv_kernel`` taps
    per channel) and the delta rule's three ``key_head_dim x value_head_dim`` products
    per value head and token (the recurrent form). Sparse attention (DeepSeek-V3.2, GLM-5):
    a query attends to ``min(position + 1, index_topk)`` keys (causal), and a layer with
    an indexer of its own adds ``2 * index_n_heads * (index_head_dim + 1)`` per pair.
    """
    tokens = _check_tokens(micro_batch_size, seq_len)
    h = spec.hidden_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    gate = q if spec.linear_attention is not None else 0  # gated attention's q_proj
    proj = 2 * (h * (q + gate) + 2 * h * kv + q * h) * tokens
    if spec.is_mla:  # the latent projections: every attention weight of the layer once
        proj = 2 * _attention_weights(spec) * tokens
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    # scores (q . k) and values (p . v) per pair; multi-latent values are v_head_dim wide
    v_head = spec.v_head_dim if spec.is_mla else spec.head_dim
    attn = 2 * (q + spec.num_attention_heads * v_head) * pairs * micro_batch_size
    dense = 2 * 3 * h * spec.intermediate_size * tokens
    moe = (
        2
        * (h * spec.num_experts + spec.num_experts_per_tok * 3 * h * spec.moe_intermediate_size)
        * tokens
    )
    if spec.index_topk:  # sparse attention: each query attends to its top-k keys
        top = spec.index_topk
        near = min(seq_len, top)  # causal: query i keeps min(i + 1, top) keys
        kept = near * (near + 1) // 2 + (seq_len - near) * top if causal else seq_len * near
        attn = 2 * (q + spec.num_attention_heads * v_head) * kept * micro_batch_size
    mixer = (_linear_flops(spec, tokens), proj + attn)
    layers = tuple(
        3.0
        * (
            mixer[not is_linear_layer(spec, i)]
            + _indexer_flops(spec, i, pairs * micro_batch_size, tokens)
            + (moe if m else dense)
        )
        for i, m in enumerate(_moe_flags(spec, moe_layer_freq))
    )
    out = 2 * h * spec.vocab_size * tokens
    mtp = sum(
        proj + attn + (moe if moe_at(spec, i) else dense) + 2 * 2 * h * h * tokens + out
        for i in spec.mtp_layer_ids
    )
    return LayerCosts(layers=layers, embedding=0.0, head=3.0 * (out + mtp), unit="flops")


def _indexer_flops(spec: ModelSpec, layer: int, pairs: int, tokens: int) -> int:
    """Forward FLOPs a sparse-attention indexer adds to layer ``layer`` over ``pairs``
    (query, key) pairs of the micro-batch: ``index_n_heads`` scores of ``index_head_dim`` and
    their weighted sum per pair; a layer reusing another's top-k has no indexer, so its
    projections (counted with layer 0's attention weights) are taken back out."""
    if not spec.indexer_layers:
        return 0
    heads, dim = spec.index_n_heads, spec.index_head_dim
    if spec.indexer_layers[layer]:
        return 2 * heads * (dim + 1) * pairs
    weights = heads * dim * spec.q_lora_rank + dim * spec.hidden_size + heads * spec.hidden_size
    return -2 * weights * tokens


def _linear_flops(spec: ModelSpec, tokens: int) -> int:
    """Forward FLOPs of one gated-delta-net layer over ``tokens`` (0 without one)."""
    la = spec.linear_attention
    if la is None:
        return 0
    h, qkv = spec.hidden_size, 2 * la.key_dim + la.value_dim
    proj = 2 * h * (qkv + la.value_dim + 2 * la.value_heads) + 2 * la.value_dim * h
    rule = 2 * 3 * la.value_heads * la.key_head_dim * la.value_head_dim
    return (proj + 2 * la.conv_kernel * qkv + rule) * tokens


@beartype
def partition_model(
    spec: ModelSpec,
    num_stages: int,
    *,
    vpp: int = 1,
    cost_model: CostModel = param_costs,
    balance_ranks: bool = True,
    allow_empty_ends: bool = False,
) -> StagePlan:
    """:func:`partition_pipeline` of ``spec``'s layers under ``cost_model``; the
    embedding cost goes to the first chunk, the head's to the last (with
    ``allow_empty_ends`` those two chunks may hold no decoder layer)."""
    costs = cost_model(spec)
    if len(costs.layers) != spec.num_layers:
        raise PlanError(
            f"cost model gave {len(costs.layers)} layer costs for a model with num_layers="
            f"{spec.num_layers}; it must cost every decoder layer once"
        )
    return partition_pipeline(
        np.asarray(costs.layers, dtype=np.float64),
        num_stages,
        vpp=vpp,
        first_extra=costs.embedding,
        last_extra=costs.head,
        balance_ranks=balance_ranks,
        allow_empty_ends=allow_empty_ends,
    )
