"""FSDP2 (+ DTensor TP, + HSDP) layouts of a transformers model.

Names are the transformers 5 parameter names (``model.named_parameters()``: MoE
experts stacked as ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``; tied
``lm_head`` is the embedding and not listed twice). The mesh is the one torch builds,
row-major: ``dp_replicate`` (HSDP replicas, only when > 1), ``dp_shard`` (FSDP shards
over data x sequence parallel ranks), ``tp`` (only when > 1). ``c`` is Ulysses
sequence parallelism: the parameters are sharded over ``dp_shard = dp/replicas * cp``
ranks as if all were data parallel, and :func:`fsdp2_data_mesh` factors ``dp_shard``
into ``(dp_shard, cp)``, ``cp`` fastest: the ``cp`` ranks of one data-parallel share
(equal ``dp_replicate``, data-shard and ``tp`` coordinates) take the same rows and
each computes ``T/cp`` of their tokens. ``pp``, ``ep``, ``etp`` and ``vpp`` must be 1.

TP plan by each tensor's role in its family's table
(:class:`~areal_fn.model.families.tp_role.TpRole`, like AReaL's plan by module):
column roles (q/k/v, gate/up, multi-latent attention's up projections) ``Shard(0)``,
head roles (gpt-oss's attention sinks, a gated delta net's ``A_log`` / ``dt_bias``)
``Shard(0)``, row roles (o/down) ``Shard(1)`` (their biases replicated), the vocabulary
tensors ``Shard(0)`` (``tp_embeddings=False`` replicates them); routed experts (per-expert
or stacked) and every other role replicated (a gated delta net's ``[q; k; v]`` tensors
among them: each rank computes on its rows, :mod:`areal_fn.model.linear_tp`). FSDP2 then shards dim 0 of
every parameter over ``dp_shard``; on a dim that TP already shards it produces
``StridedShard(0, split_factor=tp)`` (right-to-left sharding), elsewhere ``Shard(0)``.
"""

import attrs

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece, Layout, LayoutKind, LogicalTensor
from areal_fn.layouts.vocab import vocab_tensors
from areal_fn.model.families.roles import tp_record
from areal_fn.model.families.tp_role import TpRole
from areal_fn.model.hf_memory import MemoryTensor, hf_memory_view
from areal_fn.model.spec import ModelSpec
from areal_fn.sharding.mesh import Axis, Mesh
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding
from areal_fn.strategy.allocation import Backend, ParallelDims
from areal_fn.strategy.coerce import Strategy, as_dims
from areal_fn.strategy.rules import check_dims
from areal_fn.typecheck import beartype

_BY_ROLE: dict[TpRole, Placement] = {
    TpRole.COLUMN: Shard(dim=0),
    TpRole.KV: Shard(dim=0),
    TpRole.HEAD: Shard(dim=0),
    TpRole.DELTA_HEAD: Shard(dim=0),
    TpRole.ROW: Shard(dim=1),
}


@attrs.frozen(kw_only=True)
class Fsdp2Options:
    """Choices that change an FSDP2 layout. ``hsdp_replicas`` must divide ``dp``; it is
    the HSDP replica count when the dims do not give one (``dp_replicate``, ``fsdp:d2x4``)."""

    hsdp_replicas: int = 1
    tp_embeddings: bool = True


def fsdp2_mesh(dims: ParallelDims, options: Fsdp2Options) -> Mesh:
    """The mesh of the parameters' DTensors (HSDP replicas from ``dims.dp_replicate``,
    else from ``options.hsdp_replicas``)."""
    replicas = options.hsdp_replicas
    if dims.dp_replicate > 1:
        if replicas not in (1, dims.dp_replicate):
            raise LayoutError(
                f"dims.dp_replicate={dims.dp_replicate} and hsdp_replicas={replicas} both give the "
                f"HSDP replicas and differ; give them once (leave hsdp_replicas=1)"
            )
        replicas = dims.dp_replicate
    if dims.dp % replicas:
        raise LayoutError(
            f"hsdp_replicas={replicas} does not divide dp={dims.dp}; HSDP splits the data-parallel "
            f"ranks into replicas x shards, use hsdp_replicas in {[d for d in range(1, dims.dp + 1) if dims.dp % d == 0]}"
        )
    axes: dict[Axis, int] = {}
    if replicas > 1:
        axes[Axis.DP_REPLICATE] = replicas
    axes[Axis.DP_SHARD] = dims.dp // replicas * dims.cp
    if dims.tp > 1:
        axes[Axis.TP] = dims.tp
    return Mesh(names=tuple(axes), sizes=tuple(axes.values()))


@beartype
def fsdp2_data_mesh(mesh: Mesh, cp: int) -> Mesh:
    """``mesh`` (an FSDP2 layout's) with ``dp_shard`` factored into data shards x ``cp``.

    The ranks are unchanged; the ``cp`` axis is the fastest part of the ``dp_shard``
    coordinate. Its groups (``groups(Axis.CP)``) are the sequence-parallel groups;
    ``dp_replicate`` and the new ``dp_shard`` give a rank's data-parallel share.
    """
    shards = mesh.axis_size(Axis.DP_SHARD)
    if cp < 1 or shards % cp:
        raise LayoutError(
            f"cp={cp} does not divide dp_shard={shards} of {mesh}; the FSDP2 mesh has "
            "dp_shard = dp/replicas * cp, build it with fsdp2_mesh from the same dims"
        )
    return mesh.split(Axis.DP_SHARD, dp_shard=shards // cp, cp=cp)


def tp_placement(
    model: ModelSpec, canonical: str, options: Fsdp2Options, *, vocab: bool
) -> Placement:
    """The TP placement of the parameter holding canonical tensor ``canonical`` (its first
    piece, for a parameter fusing several), by the tensor's role in the family's table
    (``vocab``: a vocabulary tensor, :func:`~areal_fn.layouts.vocab.vocab_tensors`)."""
    if vocab:
        return Shard(dim=0) if options.tp_embeddings else Replicate()
    rec = tp_record(model.family, canonical)
    if rec is None or rec.expert or rec.stacked:
        return Replicate()  # the FSDP2 engine does not split experts over tp
    return _BY_ROLE.get(rec.tp, Replicate())


def fsdp2_sharding(
    name: str,
    shape: tuple[int, ...],
    dims: ParallelDims,
    mesh: Mesh,
    options: Fsdp2Options,
    *,
    tp: Placement,
) -> Sharding:
    """The sharding FSDP2 (+TP) gives parameter ``name`` of ``shape`` on ``mesh``, placed
    ``tp`` over the ``tp`` axis (:func:`tp_placement`).

    ``LayoutError`` when FSDP2 would store the parameter unlike its own placements: a
    TP row-sharded dim not divisible by ``tp`` over more than two FSDP shards.
    """
    dp_shard = mesh.axis_size(Axis.DP_SHARD)
    row_tp = isinstance(tp, Shard) and tp.dim == 0 and dims.tp > 1
    if row_tp and shape[0] % dims.tp and dp_shard > 2:
        raise LayoutError(
            f"{name}: dim 0 of size {shape[0]} is not divisible by tp={dims.tp}, and FSDP2 over "
            f"dp_shard={dp_shard} (> 2) then stores shards its own placements (StridedShard) do not "
            "describe; pad the dim to a multiple of tp, use tp_embeddings=False for the vocabulary, or "
            "keep dp_shard <= 2"
        )
    placements: list[Placement] = []
    if Axis.DP_REPLICATE in mesh.names:
        placements.append(Replicate())
    placements.append(StridedShard(dim=0, split_factor=dims.tp) if row_tp else Shard(dim=0))
    if Axis.TP in mesh.names:
        placements.append(tp)
    return Sharding(mesh=mesh, placements=tuple(placements))


def memory_sharding(
    model: ModelSpec,
    mt: MemoryTensor,
    dims: ParallelDims,
    mesh: Mesh,
    options: Fsdp2Options,
    *,
    vocab: bool,
) -> Sharding:
    """The sharding of transformers' in-memory tensor ``mt`` under FSDP2 (+TP): a buffer
    whole on every rank (FSDP2 shards parameters only), a parameter by
    :func:`fsdp2_sharding` with the TP placement of its first canonical piece."""
    if mt.buffer:
        return Sharding.replicated(mesh)
    tp = tp_placement(model, mt.pieces[0].canonical, options, vocab=vocab)
    return fsdp2_sharding(mt.name, mt.shape, dims, mesh, options, tp=tp)


@beartype
def fsdp2_layout(
    model: ModelSpec, dims: Strategy, *, options: Fsdp2Options = Fsdp2Options()
) -> Layout:
    """Every rank's parameters under FSDP2 (+TP, +HSDP) for the ``fsdp`` component ``dims``.

    ``dims`` takes ``dp``, ``tp`` and ``cp``; ``LayoutError`` for ``pp``, ``ep``, ``etp``
    or ``vpp`` other than 1 (FSDP2 has no pipeline stages and does not split experts:
    use :func:`~areal_fn.layouts.megatron.megatron_layout`) and for degrees the model
    does not divide (:func:`~areal_fn.strategy.rules.check_dims`). ``cp`` ranks are
    FSDP shards like ``dp`` ranks (``dp_shard = dp/hsdp_replicas * cp``); the FSDP2
    engine runs them as Ulysses sequence parallelism (:func:`fsdp2_data_mesh`).
    ``dims`` may also be an fsdp allocation string or component (``"fsdp:d2x4t2"``).
    """
    dims = as_dims(dims, caller="fsdp2_layout", backends=(Backend.FSDP,))
    check_dims(
        model,
        "fsdp2",
        dims,
        tp_embeddings=options.tp_embeddings,
        hsdp_replicas=options.hsdp_replicas,
    )
    mesh = fsdp2_mesh(dims, options)
    tensors = []
    vocab = vocab_tensors(model)
    for mt in hf_memory_view(model):
        if model.tie_word_embeddings and mt.name == model.family.outer.output:
            continue  # the same Parameter as the embedding
        sharding = memory_sharding(model, mt, dims, mesh, options, vocab=mt.name in vocab)
        fusion = tuple(
            FusionPiece(
                canonical=p.canonical, canonical_box=p.canonical_box, logical_box=p.memory_box
            )
            for p in mt.pieces
        )
        tensors.append(
            LogicalTensor(
                name=mt.name,
                shape=mt.shape,
                dtype=mt.dtype,
                fusion=fusion,
                sharding=sharding,
            )
        )
    return Layout(
        kind=LayoutKind.FSDP2, world_size=mesh.size, canonical=model.tensors, tensors=tuple(tensors)
    )
