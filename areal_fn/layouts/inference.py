"""Inference-engine layouts (SGLang, vLLM): tensor parallel shards of HF weights.

The engines load HF checkpoint names and shard them at load time; weight updates
(`update_weights_from_distributed`) send HF names, so the layout is over canonical
names. Each tensor is placed by its role in the family's table
(:class:`~areal_fn.model.families.tp_role.TpRole`); the rules (both engines):

- ``q_proj``, ``gate_proj``, ``up_proj`` (+ biases), experts' gate/up: column-wise,
  ``Shard(0)``; ``o_proj``, ``down_proj``, experts' down: row-wise, ``Shard(1)``.
- ``k_proj`` / ``v_proj``: when ``tp <= num_key_value_heads`` each rank holds
  ``kv/tp`` whole heads (``Shard(0)``); when ``tp`` exceeds them (it must then be a
  multiple), ``tp`` factors into ``tp_kv = kv`` x ``tp_rep = tp/kv``: rank ``r`` holds
  KV head ``r // tp_rep`` and each head is replicated on ``tp_rep`` ranks.
- ``embed_tokens`` / ``lm_head``: the vocabulary is padded to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``) and split evenly (``Shard(0)``); padding rows hold
  no weights.
- multi-latent attention (DeepSeek-V3): ``q_b_proj`` / ``kv_b_proj`` (and ``q_proj``)
  column-wise by heads, ``o_proj`` row-wise; the down projections ``q_a_proj`` /
  ``kv_a_proj_with_mqa`` and their norms are replicated (there are no KV heads).
- gpt-oss: the attention sinks by head (``Shard(0)``); the stacked experts
  ``gate_up_proj [E, H, 2I]`` by contiguous chunks of its interleaved gate/up columns
  (``Shard(2)``: rank ``r`` holds units ``r*I/tp .. (r+1)*I/tp``, gate and up
  alternating, as vLLM's and SGLang's gpt-oss loaders slice it), ``gate_up_proj_bias``
  likewise (``Shard(1)``), ``down_proj [E, I, H]`` by rows (``Shard(1)``);
  ``down_proj_bias`` and the router (weight and bias) replicated.
- gated delta nets (Qwen3-Next, Qwen3.5; vLLM's ``qwen_gdn_linear_attn``): each rank
  holds ``linear_num_key_heads / tp`` key heads and their value heads
  (:mod:`areal_fn.model.linear_tp`): ``in_proj_qkvz`` / ``in_proj_ba`` (rows grouped per
  key head), ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``A_log`` and ``dt_bias``
  ``Shard(0)``; ``out_proj`` row-wise; ``norm`` replicated; ``conv1d`` and
  ``in_proj_qkv`` (``[q; k; v]``) one tensor whose rows are reordered rank by rank
  (each rank's queries, keys, values: vLLM's ``mamba_v2_sharded_weight_loader`` for
  ``conv1d``, its merged ``in_proj_qkvz`` shards 0-2 for ``in_proj_qkv``), then ``Shard(0)``.
- norms, q/k norms and the MoE router are replicated.
- multi-token-prediction layers (:mod:`areal_fn.model.mtp`) on the last stage: their
  decoder layer by the rules above, ``embed_tokens`` and ``shared_head.head`` like the
  main embedding, ``enorm``, ``hnorm``, ``shared_head.norm`` and ``eh_proj``
  replicated (both engines build ``eh_proj`` as an unsharded linear).
- pipeline stages (``p``): layer ``i`` on stage ``s`` by an even split, the first
  ``L % pp`` stages one layer longer; embeddings on stage 0, final norm and head on the
  last.
- tied embeddings (``tie_word_embeddings``) with ``p > 1``: the last stage also holds
  the embedding, as its output layer: a tensor ``lm_head.weight`` made of
  ``model.embed_tokens.weight``, padded and split over TP exactly like the embedding
  (vLLM builds ``embed_tokens`` on the last rank too and ties its ``ParallelLMHead``
  to it; SGLang's Qwen2/Qwen3 build a ``ParallelLMHead`` there and load
  ``model.embed_tokens.weight`` into it). With ``p = 1`` the engines use the
  embedding itself as the head: one tensor. Sources: ``docs/inference.md``.

Degrees: ``d``, ``t``, ``p``; anything else is refused
(:func:`~areal_fn.strategy.rules.check_dims`).

Mesh: ``(dp, pp, tp)``, replicas outermost; ``tp`` varies fastest.
"""

from areal_fn.layouts.layout import FusionPiece, Layout, LayoutKind, LogicalTensor
from areal_fn.layouts.vocab import vocab_tensors
from areal_fn.model.families.roles import tp_record, tp_role
from areal_fn.model.families.tp_role import TpRole
from areal_fn.model.linear_tp import delta_qkv_rows
from areal_fn.model.spec import ModelSpec, layer_of
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Axis, Mesh
from areal_fn.sharding.placement import Placement, Replicate, Shard
from areal_fn.sharding.sharding import Sharding
from areal_fn.strategy.allocation import Backend, ParallelDims
from areal_fn.strategy.coerce import Strategy, as_dims
from areal_fn.strategy.rules import VOCAB_PADDING, check_dims, engine_padded_vocab
from areal_fn.typecheck import beartype

__all__ = ["VOCAB_PADDING", "inference_layout", "layer_stage"]


def layer_stage(layer: int, num_layers: int, pp: int) -> int:
    q, extra = divmod(num_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + q + (s < extra))
    for s in range(pp):
        if bounds[s] <= layer < bounds[s + 1]:
            return s
    raise AssertionError("layer out of range")


@beartype
def inference_layout(
    model: ModelSpec, dims: Strategy, *, vocab_multiple: int = VOCAB_PADDING
) -> Layout:
    """Every rank's weights in an SGLang / vLLM deployment of ``dims`` (``d``, ``t``, ``p``).

    ``vocab_multiple`` is the engines' vocabulary padding (64); 1 means unpadded, as a
    plain DTensor tensor-parallel model holds it. ``dims`` may also be an sglang / vllm
    allocation string or component (``"sglang:d2t4"``).
    """
    dims = as_dims(dims, caller="inference_layout", backends=(Backend.SGLANG, Backend.VLLM))
    check_dims(model, "inference", dims, vocab_multiple=vocab_multiple)
    tp, nkv = dims.tp, model.num_key_value_heads
    mesh = Mesh(names=(Axis.DP, Axis.PP, Axis.TP), sizes=(dims.dp, dims.pp, tp))
    kv_mesh = mesh.split(Axis.TP, **{Axis.TP_KV: min(tp, nkv), Axis.TP_REP: max(1, tp // nkv)})
    vpad = engine_padded_vocab(model.vocab_size, vocab_multiple)
    tensors = [
        _logical_tensor(spec, model, dims, mesh=mesh, kv_mesh=kv_mesh, vpad=vpad)
        for spec in model.tensors
    ]
    if model.tie_word_embeddings and dims.pp > 1:
        tensors.append(_tied_output_layer(model, dims, mesh=mesh, vpad=vpad))
    return Layout(
        kind=LayoutKind.INFERENCE,
        world_size=mesh.size,
        canonical=model.tensors,
        tensors=tuple(tensors),
    )


def _stage(name: str, model: ModelSpec, pp: int) -> int:
    """The pipeline stage holding canonical tensor ``name``: its layer's, else the
    first (embeddings) or the last (final norm, head)."""
    layer = layer_of(name)
    if layer is not None and layer >= model.num_layers:
        return pp - 1  # a multi-token-prediction layer: after the last decoder layer
    if layer is not None:
        return layer_stage(layer, model.num_layers, pp)
    if name == model.family.outer.embedding:
        return 0
    return pp - 1


def _tp_placement(model: ModelSpec, spec: TensorSpec, *, vocab: bool) -> Placement:
    """The ``tp`` placement of canonical tensor ``spec`` by its role (KV weights: on
    ``tp_kv``; ``vocab``: a vocabulary tensor). A stacked expert tensor (``[E, in, out]``,
    gpt-oss: vLLM's and SGLang's loaders) splits its last dim for a column role (the
    interleaved gate/up columns in contiguous chunks) and dim 1 for a row role."""
    if vocab:
        return Shard(dim=0)
    rec = tp_record(model.family, spec.name)
    if rec is None:
        return Replicate()
    if rec.tp in (TpRole.COLUMN, TpRole.KV, TpRole.HEAD, TpRole.DELTA_HEAD):
        return Shard(dim=len(spec.shape) - 1) if rec.stacked else Shard(dim=0)
    if rec.tp is TpRole.ROW:
        return Shard(dim=1)
    return Replicate()


def _logical_tensor(
    spec: TensorSpec, model: ModelSpec, dims: ParallelDims, *, mesh: Mesh, kv_mesh: Mesh, vpad: int
) -> LogicalTensor:
    """The engines' tensor of canonical ``spec``: one fusion piece, vocab rows padded to
    ``vpad``, KV weights on ``kv_mesh`` (``tp`` split into ``tp_kv`` x ``tp_rep``)."""
    name, shape = spec.name, spec.shape
    fusion: tuple[FusionPiece, ...] = (
        FusionPiece(canonical=name, canonical_box=Box.full(shape), logical_box=Box.full(shape)),
    )
    vocab = name in vocab_tensors(model)
    lshape = (vpad, shape[1]) if vocab else shape
    placement = _tp_placement(model, spec, vocab=vocab)
    if tp_role(model.family, name) is TpRole.DELTA_QKV and dims.tp > 1:
        fusion, placement = _delta_qkv_fusion(spec, model, dims.tp), Shard(dim=0)
    placements: tuple[Placement, ...]
    if tp_role(model.family, name) is TpRole.KV:
        m = kv_mesh
        placements = (Replicate(), Replicate(), placement, Replicate())
    else:
        m = mesh
        placements = (Replicate(), Replicate(), placement)
    return LogicalTensor(
        name=name,
        shape=lshape,
        dtype=spec.dtype,  # the canonical tensor's (a float32 router stays float32)
        fusion=fusion,
        sharding=Sharding(mesh=m, placements=placements),
        present=((Axis.PP, _stage(name, model, dims.pp)),),
    )


def _delta_qkv_fusion(spec: TensorSpec, model: ModelSpec, tp: int) -> tuple[FusionPiece, ...]:
    """A gated delta net's ``[q; k; v]`` tensor as the engines hold it: rows reordered
    rank by rank, each rank's queries, keys and values (:func:`delta_qkv_rows`), so that
    ``Shard(0)`` gives every rank its own."""
    la = model.linear_attention
    assert la is not None  # a DELTA_QKV tensor is a linear-attention family's
    rest = tuple((0, d) for d in spec.shape[1:])
    pieces, at = [], 0
    for r in range(tp):
        for start, stop in delta_qkv_rows(la, tp, r):
            pieces.append(
                FusionPiece(
                    canonical=spec.name,
                    canonical_box=Box(ranges=((start, stop), *rest)),
                    logical_box=Box(ranges=((at, at + stop - start), *rest)),
                )
            )
            at += stop - start
    return tuple(pieces)


def _tied_output_layer(
    model: ModelSpec, dims: ParallelDims, *, mesh: Mesh, vpad: int
) -> LogicalTensor:
    """The last stage's output layer of a tied model: a copy of the embedding the engines
    hold there, padded and split over ``tp`` like the embedding."""
    hidden = model.hidden_size
    rows = Box(ranges=((0, model.vocab_size), (0, hidden)))
    return LogicalTensor(
        name=model.family.outer.output,
        shape=(vpad, hidden),
        dtype=model.dtype,
        fusion=(
            FusionPiece(
                canonical=model.family.outer.embedding, canonical_box=rows, logical_box=rows
            ),
        ),
        sharding=Sharding(mesh=mesh, placements=(Replicate(), Replicate(), Shard(dim=0))),
        present=((Axis.PP, dims.pp - 1),),
    )
