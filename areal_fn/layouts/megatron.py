"""Megatron-Core layouts: parameter names, fusion maps and shardings of a `GPTModel`.

Rank order is Megatron's ``tp-cp-ep-dp-pp`` (tp fastest). Dense tensors live on the
mesh ``(pp, dp, cp, tp)``; expert tensors on the expert mesh ``(pp, edp, ep, etp)``
over the same ranks (MoE parallel folding). Fusion maps:

- ``linear_qkv``: rows grouped per query group ``g``: ``[q heads of g; k_g; v_g]``,
  each head ``head_dim`` rows; TP shards whole groups (``Shard(0)``).
- ``linear_fc1``: ``[gate; up]``; TP rank ``r`` holds ``[gate_r; up_r]``, which is
  ``StridedShard(0, split_factor=2)``.
- gpt-oss's experts, from stacked ``[E, ...]`` canonical tensors: ``linear_fc1`` of
  expert ``e`` is ``[W[e][:, ::2].T; W[e][:, 1::2].T]`` of ``gate_up_proj [E, H, 2I]``
  (pieces with a stride and a transpose, :class:`~areal_fn.sharding.strided.View`), its
  bias likewise, ``linear_fc2`` is ``down_proj[e].T``, its bias ``down_proj_bias[e]``.
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
``model.embed_tokens.weight``). Multi-token-prediction layers: Megatron-Core's MTP block
on the last chunk (:mod:`areal_fn.model.mtp`), the final norm then with the last
decoder layer.
"""

from collections.abc import Callable
from typing import Literal

import attrs

from areal_fn.errors import LayoutError
from areal_fn.layouts.gated_delta import gated_qkv_fusion, gdn_conv_fusion, gdn_in_proj_fusion
from areal_fn.layouts.layout import FusionPiece, Layout, LayoutKind, LogicalTensor
from areal_fn.layouts.vocab import padded_vocab_size
from areal_fn.model.families.mapping import (
    Fusion,
    MegatronTensor,
    expert_runs,
    select,
)
from areal_fn.model.families.serving import MtpBlock
from areal_fn.model.linear_attention import is_linear_layer
from areal_fn.model.mtp import moe_at
from areal_fn.model.spec import ModelSpec, condition_flags
from areal_fn.pipeline.partition import StagePlan
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Axis, Mesh
from areal_fn.sharding.placement import Placement, Replicate, Shard
from areal_fn.sharding.sharding import Sharding
from areal_fn.sharding.strided import View
from areal_fn.strategy.allocation import Backend, ParallelDims
from areal_fn.strategy.coerce import Strategy, as_dims
from areal_fn.strategy.rules import check_dims
from areal_fn.typecheck import beartype

Naming = Literal["local", "te"]

_DENSE_AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)
_EXPERT_AXES = (Axis.PP, Axis.EDP, Axis.EP, Axis.ETP)


@attrs.frozen(kw_only=True)
class MegatronMeshes:
    """The dense and expert meshes of one Megatron strategy (same ranks)."""

    dense: Mesh
    expert: Mesh

    @classmethod
    def of(cls, dims: ParallelDims) -> "MegatronMeshes":
        return cls(
            dense=Mesh(names=_DENSE_AXES, sizes=(dims.pp, dims.dp, dims.cp, dims.tp)),
            expert=Mesh(names=_EXPERT_AXES, sizes=(dims.pp, dims.edp, dims.ep, dims.etp)),
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
    model: ModelSpec, sources: tuple[str, ...], cols: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[FusionPiece, ...]]:
    """Fusion map of a fused QKV tensor from canonical ``(q, k, v)`` of trailing shape ``cols``:
    rows grouped per query group ``g``, ``[q heads of g; k_g; v_g]``."""
    hd, nq, nkv = model.head_dim, model.num_attention_heads, model.num_key_value_heads
    qpg = nq // nkv
    q, k, v = sources
    pieces = []
    row = 0
    for g in range(nkv):
        for name, lo, n in ((q, g * qpg * hd, qpg * hd), (k, g * hd, hd), (v, g * hd, hd)):
            pieces.append(_rows(name, (lo, lo + n), row, cols))
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
    ``pp*vpp`` divides the layers; else the embedding and the loss each count as one
    layer, as Megatron's ``account_for_embedding/loss_in_pipeline_split`` (set by the
    published recipes) count them, so the first chunk holds fewer layers, not more
    (:func:`~areal_fn.pipeline.partition.split_evenly` with ``account_for_ends=True``).
    With multi-token-prediction layers and more than one chunk they count too, as layers
    of the last chunk (``mtp_layers``): the published DeepSeek-V3 layouts put the MTP
    layer with the loss at the end (``...|mL``)."""
    from areal_fn.pipeline.partition import split_evenly

    k, ones = dims.pp * dims.vpp, [1.0] * model.num_layers
    if model.mtp_layers and k > 1:  # the MTP layers and the loss in the last chunk
        mtp = model.mtp_layers
        return split_evenly(ones, dims.pp, vpp=dims.vpp, account_for_ends=True, mtp_layers=mtp)
    if model.num_layers % k == 0:
        return default_stages(model, dims)
    return split_evenly(ones, dims.pp, vpp=dims.vpp, account_for_ends=True)


@beartype
def megatron_layout(
    model: ModelSpec,
    dims: Strategy,
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
    Decoder layers follow the family's table
    (:attr:`~areal_fn.model.families.Family.megatron`). The layout carries its stage
    plan (``Layout.stages``). ``LayoutError`` for degrees the model does not divide, and
    for ``ep``/``etp`` > 1 on a dense model (:func:`~areal_fn.strategy.rules.check_dims`).
    ``dims`` may also be a megatron allocation string or component (``"megatron:t2p2"``).
    """
    dims = as_dims(dims, caller="megatron_layout", backends=(Backend.MEGATRON,))
    check_dims(model, "megatron", dims)
    if naming == "te" and model.linear_attention is not None:
        raise LayoutError(
            f"naming='te' for {model.model_type}: the Transformer-Engine spec's GatedDeltaNet "
            "out_norm is zero-centred ((1 + w), as every norm of the model), while the "
            "checkpoint's linear_attn.norm.weight is the plain w of a gated RMSNorm: the values "
            "differ by 1, no piece of the canonical tensor; use naming='local' (the spec this "
            "project builds)"
        )
    plan = stages if stages is not None else default_stages(model, dims)
    if plan.num_layers != model.num_layers or plan.num_stages != dims.pp or plan.vpp != dims.vpp:
        raise LayoutError(
            f"stage plan covers {plan.num_layers} layers in {plan.num_stages} stages x vpp {plan.vpp}, but the "
            f"model has {model.num_layers} layers and the strategy pp={dims.pp}, vpp={dims.vpp}"
        )
    build = _Builder(
        model=model,
        dims=dims,
        meshes=MegatronMeshes.of(dims),
        naming=naming,
        grouped_gemm=grouped_gemm,
        vpad=padded_vocab_size(model.vocab_size, tp=dims.tp, divisible_by=vocab_divisible_by),
        shapes={t.name: t.shape for t in model.tensors},
        dtypes={t.name: t.dtype for t in model.tensors},
    )
    for chunk in range(plan.num_chunks):
        stage = chunk % dims.pp
        pre = f"model{chunk // dims.pp}." if dims.vpp > 1 else ""
        last = chunk == plan.num_chunks - 1
        if chunk == 0 or (last and model.mtp_layers):
            build.embedding(pre, stage, mtp=last)
        for local, layer in enumerate(plan.chunk_layers(chunk)):
            build.layer(f"{pre}decoder.layers.{local}.", layer, stage)
        if chunk == final_norm_chunk(model, plan):
            build.final_norm(pre, stage)
        if last:
            build.head(pre, stage)
            build.mtp(pre, stage)
    _check_covered(model, build.tensors)
    return Layout(
        kind=LayoutKind.MEGATRON,
        world_size=build.meshes.dense.size,
        canonical=model.tensors,
        tensors=tuple(build.tensors),
        stages=plan,
    )


def final_norm_chunk(model: ModelSpec, plan: StagePlan) -> int:
    """The chunk holding ``decoder.final_layernorm``: the last one; with MTP layers the
    one with the last decoder layer, as Megatron-Core places it then (the last chunk may
    hold the MTP block and the loss alone)."""
    if not model.mtp_layers:
        return plan.num_chunks - 1
    return max(j for j in range(plan.num_chunks) if plan.chunk_layers(j))


def _check_covered(model: ModelSpec, tensors: list[LogicalTensor]) -> None:
    """Every canonical tensor feeds some Megatron parameter (a family table that misses one
    would otherwise drop it silently)."""
    fed = {f.canonical for t in tensors for f in t.fusion}
    left = [n for n in model.tensor_names if n not in fed]
    if left:
        more = f" and {len(left) - 5} more" if len(left) > 5 else ""
        raise LayoutError(
            f"{model.model_type}: no record of its Megatron table takes the canonical tensors "
            f"{left[:5]}{more}; add records for them to the family's table "
            "(areal_fn/model/families/)"
        )


def _rows_full(name: str, rows: int, cols: int) -> tuple[FusionPiece, ...]:
    return (_rows(name, (0, rows), 0, (cols,)),)


def stacked_expert_fusion(
    name: str, shape: tuple[int, ...], expert: int, *, glu: bool
) -> tuple[tuple[int, ...], tuple[FusionPiece, ...]]:
    """Expert ``expert`` of the stacked ``[E, *rest, n]`` tensor ``name``, its last dim
    first: ``x[e].T`` (``Fusion.EXPERT``), or with ``glu`` the de-interleaved
    ``[x[e][..., ::2].T; x[e][..., 1::2].T]`` (``Fusion.EXPERT_GLU``)."""
    *rest, n = shape[1:]
    perm = (0, len(shape) - 1, *range(1, len(shape) - 1))
    full = tuple((0, d) for d in rest)
    logical = (n, *rest)
    if not glu:
        box = Box(ranges=((expert, expert + 1), *full, (0, n)))
        view = View(step=(1,) * len(shape), perm=perm)
        return logical, (
            FusionPiece(
                canonical=name, canonical_box=box, logical_box=Box.full(logical), view=view
            ),
        )
    half = n // 2
    view = View(step=(1,) * (len(shape) - 1) + (2,), perm=perm)
    pieces = tuple(
        FusionPiece(
            canonical=name,
            canonical_box=Box(ranges=((expert, expert + 1), *full, (first, n - 1 + first))),
            logical_box=Box(ranges=((first * half, (first + 1) * half), *full)),
            view=view,
        )
        for first in (0, 1)
    )
    return logical, pieces


def mla_rope_fusion(
    model: ModelSpec, name: str, shape: tuple[int, ...], *, per_head: bool
) -> tuple[FusionPiece, ...]:
    """Multi-latent attention's q (``per_head``: ``[nope; rope]`` per head) or kv_a
    (``[latent; rope]``) projection ``name``: whole when transformers rotates interleaved
    rope dims (``rope_interleave``), as Megatron-Core does after de-interleaving them;
    otherwise each block's rope rows are laid interleaved, so that Megatron's
    de-interleave gives transformers' rotate-half order: logical row ``2i`` holds rope row
    ``i``, row ``2i + 1`` rope row ``n/2 + i`` (one piece per rope row)."""
    if model.rope_interleave:
        return _full(name, shape)
    rows, cols = shape[0], shape[1:]
    block = model.head_dim if per_head else rows
    rope, half = model.qk_rope_head_dim, model.qk_rope_head_dim // 2
    out = []
    for start in range(0, rows, block):
        nope = start + block - rope
        out.append(_rows(name, (start, nope), start, cols))
        for j in range(rope):
            src = nope + (j // 2 if j % 2 == 0 else half + j // 2)
            out.append(_rows(name, (src, src + 1), nope + j, cols))
    return tuple(out)


def _fusion(
    model: ModelSpec,
    shapes: dict[str, tuple[int, ...]],
    fusion: Fusion,
    sources: tuple[str, ...],
    expert: int = 0,
    tp: int = 1,
) -> tuple[tuple[int, ...], tuple[FusionPiece, ...]]:
    """Shape and fusion map of one table record whose canonical sources are ``sources``
    (``shapes``: the model's canonical shapes by name; ``expert``: the expert a stacked
    fusion takes; ``tp``: the TP degree the gated-delta-net fusions are laid for)."""
    missing = [s for s in sources if s not in shapes]
    if missing:
        raise LayoutError(
            f"{model.model_type}: its Megatron table names {missing} as sources, which are not "
            f"canonical tensors of this model; fix the family's table (its 'hf' names, 'when' "
            f"and 'layers') in areal_fn/model/families/"
        )
    first = shapes[sources[0]]
    if fusion is Fusion.WHOLE:
        return first, _full(sources[0], first)
    if fusion is Fusion.QKV:
        return qkv_fusion(model, sources, first[1:])
    if fusion in (Fusion.EXPERT, Fusion.EXPERT_GLU):
        return stacked_expert_fusion(sources[0], first, expert, glu=fusion is Fusion.EXPERT_GLU)
    if fusion in (Fusion.MLA_Q, Fusion.MLA_KV_A):
        return first, mla_rope_fusion(model, sources[0], first, per_head=fusion is Fusion.MLA_Q)
    if fusion is Fusion.GATED_QKV:
        return gated_qkv_fusion(model, sources, first[1:])
    if fusion in (Fusion.GDN_IN_PROJ, Fusion.GDN_IN_PROJ_SPLIT):
        return gdn_in_proj_fusion(model, sources, first[1:], tp=tp)
    if fusion is Fusion.GDN_CONV:
        return gdn_conv_fusion(model, sources[0], first[1:], tp=tp)
    return gate_up_fusion(sources[0], sources[1], first[0], first[1:])


@beartype
def layer_parameters(
    model: ModelSpec, layer: int
) -> tuple[tuple[MegatronTensor, tuple[int, ...]], ...]:
    """The Megatron-Core parameters of decoder layer ``layer`` (its family's table rows that
    apply, with the parameter's shape); an expert row stands for each of the experts."""
    flags = condition_flags(model)
    hp = f"model.layers.{layer}."
    shapes = {t.name: t.shape for t in model.tensors if t.name.startswith(hp)}
    if not shapes:
        model.layer_tensors(layer)  # the spec's error for a layer it does not have
    out = []
    linear = is_linear_layer(model, layer)
    for r in select(model.family.megatron, moe=moe_at(model, layer), flags=flags, linear=linear):
        sources = tuple(hp + h.format(e=0) for h in r.hf)
        shape, _fusion_map = _fusion(model, shapes, r.fusion, sources)
        out.append((r, shape))
    return tuple(out)


@attrs.define(kw_only=True)
class _Builder:
    """Accumulates the logical tensors of one Megatron layout (one call's scratch state)."""

    model: ModelSpec
    dims: ParallelDims
    meshes: MegatronMeshes
    naming: str
    grouped_gemm: bool
    vpad: int
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    tensors: list[LogicalTensor] = attrs.field(factory=list)
    _shardings: dict[tuple[bool, Placement], Sharding] = attrs.field(factory=dict)

    def sharding(self, tp: Placement, *, expert: bool) -> Sharding:
        key = (expert, tp)
        if key not in self._shardings:
            mesh = self.meshes.expert if expert else self.meshes.dense
            self._shardings[key] = Sharding(
                mesh=mesh, placements=(Replicate(), Replicate(), Replicate(), tp)
            )
        return self._shardings[key]

    def add(
        self,
        name: str,
        shape_fusion: tuple[tuple[int, ...], tuple[FusionPiece, ...]],
        tp: Placement,
        present: tuple[tuple[str, int], ...],
        *,
        expert: bool = False,
    ) -> None:
        shape, fusion = shape_fusion
        self.tensors.append(
            LogicalTensor(
                name=name,
                shape=shape,
                dtype=self.dtypes[fusion[0].canonical],  # a float32 router stays float32
                fusion=fusion,
                sharding=self.sharding(tp, expert=expert),
                present=present,
            )
        )

    def vocab(self, name: str, source: str, stage: int, tied: tuple[str, ...] = ()) -> None:
        """A vocab-padded tensor of ``source``; ``tied``: canonical tensors it holds in the
        same elements (the MTP layers' copies of the embedding and head)."""
        hid, vocab = self.model.hidden_size, self.model.vocab_size
        fusion = _rows_full(source, vocab, hid) + tuple(
            attrs.evolve(_rows_full(t, vocab, hid)[0], tied=True) for t in tied
        )
        self.add(name, ((self.vpad, hid), fusion), Shard(dim=0), ((Axis.PP, stage),))

    def _mtp_names(self, leaf: Callable[[MtpBlock], str]) -> tuple[str, ...]:
        """One of the family's MTP-block tensors (``leaf`` picks it) in every MTP layer."""
        n, block = self.model.num_layers, self.model.family.mtp
        if block is None:
            return ()
        return tuple(f"model.layers.{n + j}.{leaf(block)}" for j in range(self.model.mtp_layers))

    def embedding(self, pre: str, stage: int, *, mtp: bool) -> None:
        """The embedding of the first chunk, or the copy that the last chunk holds for its
        MTP layers (``mtp``; with one chunk, the same tensor). It holds the MTP layers'
        embeddings tied, and the MTP heads too when the output layer is the embedding."""
        tied = self._mtp_names(lambda b: b.embedding) if mtp else ()
        if mtp and self.model.tie_word_embeddings and self.dims.pp == 1:
            tied += self._mtp_names(lambda b: b.head)
        name = pre + "embedding.word_embeddings.weight"
        self.vocab(name, self.model.family.outer.embedding, stage, tied)

    def final_norm(self, pre: str, stage: int) -> None:
        hid = self.model.hidden_size
        norm = ((hid,), _full(self.model.family.outer.final_norm, (hid,)))
        self.add(pre + "decoder.final_layernorm.weight", norm, Replicate(), ((Axis.PP, stage),))

    def head(self, pre: str, stage: int) -> None:
        heads = self._mtp_names(lambda b: b.head)
        outer = self.model.family.outer
        if not self.model.tie_word_embeddings:
            self.vocab(pre + "output_layer.weight", outer.output, stage, heads)
        elif self.dims.pp > 1:
            self.vocab(pre + "output_layer.weight", outer.embedding, stage, heads)

    def mtp(self, pre: str, stage: int) -> None:
        """Megatron-Core's MTP block on the last chunk: per layer ``enorm``, ``hnorm``,
        ``eh_proj`` (a ``ColumnParallelLinear``: rows over ``tp``), the decoder layer as
        ``transformer_layer`` and ``final_layernorm`` (the checkpoint's
        ``shared_head.norm``); its embedding and head are the main ones (tied pieces)."""
        hid, present = self.model.hidden_size, ((Axis.PP, stage),)
        block = self.model.family.mtp
        if block is None:
            return
        for j in range(self.model.mtp_layers):
            layer = self.model.num_layers + j
            mp, hp = f"{pre}mtp.layers.{j}.", f"model.layers.{layer}."
            for own, leaf in (("enorm", block.enorm), ("hnorm", block.hnorm)):
                norm = ((hid,), _full(hp + leaf, (hid,)))
                self.add(mp + own + ".weight", norm, Replicate(), present)
            proj = ((hid, 2 * hid), _full(hp + block.eh_proj, (hid, 2 * hid)))
            self.add(mp + "eh_proj.weight", proj, Shard(dim=0), present)
            self.layer(mp + "transformer_layer.", layer, stage)
            norm = ((hid,), _full(hp + block.head_norm, (hid,)))
            self.add(mp + "final_layernorm.weight", norm, Replicate(), present)

    def layer(self, mp: str, layer: int, stage: int) -> None:
        """Decoder layer ``layer`` (HF index) as Megatron's ``mp`` (its chunk-local prefix)."""
        model = self.model
        hp = f"model.layers.{layer}."
        flags = condition_flags(model)
        linear = is_linear_layer(model, layer)
        rows = select(model.family.megatron, moe=moe_at(model, layer), flags=flags, linear=linear)
        for run in expert_runs(rows):
            if run[0].expert:
                self._experts(run, mp, hp, stage)
                continue
            r = run[0]
            sources = tuple(hp + h for h in r.hf)
            fused = _fusion(model, self.shapes, r.fusion, sources, tp=self.dims.tp)
            self.add(mp + r.name(self.naming), fused, r.placement(self.naming), ((Axis.PP, stage),))

    def _experts(self, rows: list[MegatronTensor], mp: str, hp: str, stage: int) -> None:
        """A run of per-expert records, expert-major (expert 0's tensors, then expert 1's...)."""
        per_rank = self.model.num_experts // self.dims.ep
        for e in range(self.model.num_experts):
            ep_rank, local = divmod(e, per_rank)
            present = ((Axis.PP, stage), (Axis.EP, ep_rank))
            for r in rows:
                name = r.name(self.naming, grouped_gemm=self.grouped_gemm).format(local=local)
                sources = tuple(hp + h.format(e=e) for h in r.hf)
                fused = _fusion(self.model, self.shapes, r.fusion, sources, e)
                self.add(mp + name, fused, r.placement(self.naming), present, expert=True)
