"""Megatron-Core layouts: parameter names, fusion maps and shardings of a `GPTModel`.

Rank order is Megatron's ``tp-cp-ep-dp-pp`` (tp fastest). Dense tensors live on the
mesh ``(pp, dp, cp, tp)``; expert tensors on the expert mesh ``(pp, edp, ep, etp)``
over the same ranks (MoE parallel folding). Fusion maps:

- ``linear_qkv``: rows grouped per query group ``g``: ``[q heads of g; k_g; v_g]``,
  each head ``head_dim`` rows; TP shards whole groups (``Shard(0)``).
- ``linear_fc1``: ``[gate; up]``; TP rank ``r`` holds ``[gate_r; up_r]``, which is
  ``StridedShard(0, split_factor=2)``.
- ``word_embeddings`` / ``output_layer``: vocab padded to a multiple of
  ``128 * tp`` (padding rows have no canonical source), ``Shard(0)`` over TP.

Context parallelism: Megatron-Core replicates every parameter over ``cp`` (the
sequence is split ``2*cp`` ways by its ring attention, which needs the
TransformerEngine spec); the layout says exactly that. This project's
:class:`~areal_fn.runtime.engines.megatron.MegatronEngine` builds the local spec,
whose ``DotProductAttention`` supports ``cp = 1`` only.

Pipeline: chunk ``j`` (layers of a :class:`~areal_fn.pipeline.partition.StagePlan`) runs on pp
rank ``j % pp`` as virtual stage ``j // pp``; names use the layer index local to the
chunk (``decoder.layers.{i}``), prefixed ``model{v}.`` when ``vpp > 1``. Tied
embeddings: with one stage the output layer reuses the embedding (no
``output_layer.weight``); otherwise the last stage holds a copy (pieces of
``model.embed_tokens.weight``).
"""

from typing import Literal

import attrs

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece, Layout, LogicalTensor
from areal_fn.layouts.vocab import padded_vocab_size
from areal_fn.model.spec import ModelSpec
from areal_fn.pipeline.partition import StagePlan
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.rules import check_dims
from areal_fn.typecheck import beartype

Naming = Literal["local", "te"]


@attrs.frozen(kw_only=True)
class MegatronMeshes:
    """The dense and expert meshes of one Megatron strategy (same ranks)."""

    dense: Mesh
    expert: Mesh

    @classmethod
    def of(cls, dims: ParallelDims) -> "MegatronMeshes":
        return cls(
            dense=Mesh.of(pp=dims.pp, dp=dims.dp, cp=dims.cp, tp=dims.tp),
            expert=Mesh.of(pp=dims.pp, edp=dims.edp, ep=dims.ep, etp=dims.etp),
        )


def _full(name: str, shape: tuple[int, ...]) -> tuple[FusionPiece, ...]:
    return (
        FusionPiece(canonical=name, canonical_box=Box.full(shape), logical_box=Box.full(shape)),
    )


def _rows(name: str, src: tuple[int, int], dst: int, cols: tuple[int, ...]) -> FusionPiece:
    n = src[1] - src[0]
    rest = tuple((0, c) for c in cols)
    return FusionPiece(
        canonical=name,
        canonical_box=Box(ranges=((src[0], src[1]), *rest)),
        logical_box=Box(ranges=((dst, dst + n), *rest)),
    )


def qkv_fusion(
    model: ModelSpec, prefix: str, suffix: str
) -> tuple[tuple[int, ...], tuple[FusionPiece, ...]]:
    """Fusion map of Megatron's ``linear_qkv.{suffix}`` (weight or bias) for one layer."""
    hd, nq, nkv = model.head_dim, model.num_attention_heads, model.num_key_value_heads
    qpg = nq // nkv
    cols = (model.hidden_size,) if suffix == "weight" else ()
    pieces = []
    row = 0
    for g in range(nkv):
        for part, lo, n in (
            ("q_proj", g * qpg * hd, qpg * hd),
            ("k_proj", g * hd, hd),
            ("v_proj", g * hd, hd),
        ):
            pieces.append(_rows(f"{prefix}self_attn.{part}.{suffix}", (lo, lo + n), row, cols))
            row += n
    return (row, *cols), tuple(pieces)


def gate_up_fusion(
    gate: str, up: str, inter: int, cols: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[FusionPiece, ...]]:
    """Fusion map of ``linear_fc1 = [gate; up]``."""
    return (2 * inter, *cols), (
        _rows(gate, (0, inter), 0, cols),
        _rows(up, (0, inter), inter, cols),
    )


@beartype
def default_stages(model: ModelSpec, dims: ParallelDims) -> StagePlan:
    """Megatron's default split: ``num_layers / (pp*vpp)`` layers per chunk (must divide)."""
    from areal_fn.pipeline.partition import split_evenly

    k = dims.pp * dims.vpp
    if model.num_layers % k:
        raise LayoutError(
            f"num_layers={model.num_layers} is not divisible by pp={dims.pp} x vpp={dims.vpp} = {k}: "
            "Megatron's default split needs it; pass stages=partition_pipeline(...) for an uneven split"
        )
    return split_evenly([1.0] * model.num_layers, dims.pp, vpp=dims.vpp)


@beartype
def stages_for(model: ModelSpec, dims: ParallelDims) -> StagePlan:
    """The stages every path uses when none are given: Megatron's default split when
    ``pp*vpp`` divides the layers, else the even split (the first chunks one layer
    longer, :func:`~areal_fn.pipeline.partition.split_evenly`)."""
    from areal_fn.pipeline.partition import split_evenly

    if model.num_layers % (dims.pp * dims.vpp) == 0:
        return default_stages(model, dims)
    return split_evenly([1.0] * model.num_layers, dims.pp, vpp=dims.vpp)


@beartype
def megatron_layout(
    model: ModelSpec,
    dims: ParallelDims,
    *,
    naming: Naming = "local",
    stages: StagePlan | None = None,
    grouped_gemm: bool = False,
    vocab_divisible_by: int = 128,
) -> Layout:
    """The Megatron-Core ``GPTModel`` layout of ``model`` under ``dims``.

    ``naming="te"`` uses the Transformer-Engine spec's names (layer norms fused into
    ``linear_qkv`` / ``linear_fc1``); ``grouped_gemm`` names experts
    ``mlp.experts.linear_fc1.weight{i}`` instead of ``mlp.experts.local_experts.{i}...``.
    ``LayoutError`` for degrees the model does not divide, and for ``ep``/``etp`` > 1
    on a dense model (:func:`~areal_fn.strategy.rules.check_dims`).
    """
    check_dims(model, "megatron", dims)
    plan = stages if stages is not None else default_stages(model, dims)
    if plan.num_layers != model.num_layers or plan.num_stages != dims.pp or plan.vpp != dims.vpp:
        raise LayoutError(
            f"stage plan covers {plan.num_layers} layers in {plan.num_stages} stages x vpp {plan.vpp}, but the "
            f"model has {model.num_layers} layers and the strategy pp={dims.pp}, vpp={dims.vpp}"
        )
    meshes = MegatronMeshes.of(dims)
    dense, expert = meshes.dense, meshes.expert
    dt = model.dtype
    hid = model.hidden_size
    vpad = padded_vocab_size(model.vocab_size, tp=dims.tp, divisible_by=vocab_divisible_by)
    tensors: list[LogicalTensor] = []

    shardings: dict[Placement, Sharding] = {}

    def dense_sharding(tp_placement: Placement) -> Sharding:
        if tp_placement not in shardings:
            shardings[tp_placement] = Sharding(
                mesh=dense, placements=(Replicate(), Replicate(), Replicate(), tp_placement)
            )
        return shardings[tp_placement]

    def add(
        name: str,
        shape: tuple[int, ...],
        fusion: tuple[FusionPiece, ...],
        tp_placement: Placement,
        stage: int,
    ) -> None:
        tensors.append(
            LogicalTensor(
                name=name,
                shape=shape,
                dtype=dt,
                fusion=fusion,
                sharding=dense_sharding(tp_placement),
                present=(("pp", stage),),
            )
        )

    last_chunk = plan.num_chunks - 1
    for chunk in range(plan.num_chunks):
        stage = chunk % dims.pp
        vstage = chunk // dims.pp
        pre = f"model{vstage}." if dims.vpp > 1 else ""
        if chunk == 0:
            emb = "model.embed_tokens.weight"
            add(
                pre + "embedding.word_embeddings.weight",
                (vpad, hid),
                _rows_full(emb, model.vocab_size, hid),
                Shard(dim=0),
                stage,
            )
        for local, layer in enumerate(plan.chunk_layers(chunk)):
            _layer(
                model,
                dims,
                tensors,
                add,
                expert,
                f"{pre}decoder.layers.{local}.",
                f"model.layers.{layer}.",
                layer,
                stage,
                naming,
                grouped_gemm,
            )
        if chunk == last_chunk:
            add(
                pre + "decoder.final_layernorm.weight",
                (hid,),
                _full("model.norm.weight", (hid,)),
                Replicate(),
                stage,
            )
            if not model.tie_word_embeddings:
                add(
                    pre + "output_layer.weight",
                    (vpad, hid),
                    _rows_full("lm_head.weight", model.vocab_size, hid),
                    Shard(dim=0),
                    stage,
                )
            elif dims.pp > 1:
                add(
                    pre + "output_layer.weight",
                    (vpad, hid),
                    _rows_full("model.embed_tokens.weight", model.vocab_size, hid),
                    Shard(dim=0),
                    stage,
                )
    return Layout(
        kind="megatron", world_size=dense.size, canonical=model.tensors, tensors=tuple(tensors)
    )


def _rows_full(name: str, rows: int, cols: int) -> tuple[FusionPiece, ...]:
    return (_rows(name, (0, rows), 0, (cols,)),)


def _layer(
    model,
    dims,
    tensors,
    add,
    expert: Mesh,
    mp: str,
    hp: str,
    layer: int,
    stage: int,
    naming: str,
    grouped: bool,
) -> None:  # type: ignore[no-untyped-def]
    hid, hd = model.hidden_size, model.head_dim
    nq = model.num_attention_heads
    ln_in = mp + (
        "self_attention.linear_qkv.layer_norm_weight"
        if naming == "te"
        else "input_layernorm.weight"
    )
    add(ln_in, (hid,), _full(hp + "input_layernorm.weight", (hid,)), Replicate(), stage)
    shape, fusion = qkv_fusion(model, hp, "weight")
    add(mp + "self_attention.linear_qkv.weight", shape, fusion, Shard(dim=0), stage)
    if model.qkv_bias:
        shape, fusion = qkv_fusion(model, hp, "bias")
        add(mp + "self_attention.linear_qkv.bias", shape, fusion, Shard(dim=0), stage)
    if model.qk_norm:
        add(
            mp + "self_attention.q_layernorm.weight",
            (hd,),
            _full(hp + "self_attn.q_norm.weight", (hd,)),
            Replicate(),
            stage,
        )
        add(
            mp + "self_attention.k_layernorm.weight",
            (hd,),
            _full(hp + "self_attn.k_norm.weight", (hd,)),
            Replicate(),
            stage,
        )
    add(
        mp + "self_attention.linear_proj.weight",
        (hid, nq * hd),
        _full(hp + "self_attn.o_proj.weight", (hid, nq * hd)),
        Shard(dim=1),
        stage,
    )
    if model.o_bias:
        add(
            mp + "self_attention.linear_proj.bias",
            (hid,),
            _full(hp + "self_attn.o_proj.bias", (hid,)),
            Replicate(),
            stage,
        )
    moe = model.moe_layers[layer]
    if naming == "te" and not moe:
        ln_mlp = mp + "mlp.linear_fc1.layer_norm_weight"
    else:
        ln_mlp = mp + "pre_mlp_layernorm.weight"
    add(ln_mlp, (hid,), _full(hp + "post_attention_layernorm.weight", (hid,)), Replicate(), stage)
    if not moe:
        inter = model.intermediate_size
        shape, fusion = gate_up_fusion(
            hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight", inter, (hid,)
        )
        add(mp + "mlp.linear_fc1.weight", shape, fusion, StridedShard(dim=0, split_factor=2), stage)
        if model.mlp_bias:
            shape, fusion = gate_up_fusion(
                hp + "mlp.gate_proj.bias", hp + "mlp.up_proj.bias", inter, ()
            )
            add(
                mp + "mlp.linear_fc1.bias",
                shape,
                fusion,
                StridedShard(dim=0, split_factor=2),
                stage,
            )
        add(
            mp + "mlp.linear_fc2.weight",
            (hid, inter),
            _full(hp + "mlp.down_proj.weight", (hid, inter)),
            Shard(dim=1),
            stage,
        )
        if model.mlp_bias:
            add(
                mp + "mlp.linear_fc2.bias",
                (hid,),
                _full(hp + "mlp.down_proj.bias", (hid,)),
                Replicate(),
                stage,
            )
        return
    fc1_sharding = Sharding(
        mesh=expert,
        placements=(Replicate(), Replicate(), Replicate(), StridedShard(dim=0, split_factor=2)),
    )
    fc2_sharding = Sharding(
        mesh=expert, placements=(Replicate(), Replicate(), Replicate(), Shard(dim=1))
    )
    e_count = model.num_experts
    add(
        mp + "mlp.router.weight",
        (e_count, hid),
        _full(hp + "mlp.gate.weight", (e_count, hid)),
        Replicate(),
        stage,
    )
    inter = model.moe_intermediate_size
    per_rank = e_count // dims.ep
    for e in range(e_count):
        ep_rank, local = divmod(e, per_rank)
        fc1 = (
            f"mlp.experts.linear_fc1.weight{local}"
            if grouped
            else f"mlp.experts.local_experts.{local}.linear_fc1.weight"
        )
        fc2 = (
            f"mlp.experts.linear_fc2.weight{local}"
            if grouped
            else f"mlp.experts.local_experts.{local}.linear_fc2.weight"
        )
        ehp = f"{hp}mlp.experts.{e}."
        present = (("pp", stage), ("ep", ep_rank))
        shape, fusion = gate_up_fusion(
            ehp + "gate_proj.weight", ehp + "up_proj.weight", inter, (hid,)
        )
        tensors.append(
            LogicalTensor(
                name=mp + fc1,
                shape=shape,
                dtype=model.dtype,
                fusion=fusion,
                sharding=fc1_sharding,
                present=present,
            )
        )
        tensors.append(
            LogicalTensor(
                name=mp + fc2,
                shape=(hid, inter),
                dtype=model.dtype,
                fusion=_full(ehp + "down_proj.weight", (hid, inter)),
                sharding=fc2_sharding,
                present=present,
            )
        )
