"""`Census`: a layout's tensors counted by shape, sharding and presence.

How many elements a rank holds depends on a tensor's shape, its sharding and its
presence constraints, never on its name or fusion map. A census groups a layout's
logical tensors by those three and counts each group; it also records which decoder
layers are present where (activations follow layers). It is far smaller than the
layout of a big MoE model: Qwen3-235B-A22B under Megatron ``d32p2t4e8`` has 24,725
logical tensors and 44 groups.

- :func:`census_of` derives the census of any :class:`~areal_fn.layouts.layout.Layout`.
- :func:`megatron_census` and :func:`fsdp2_census` compute the very same census from a
  model and parallel degrees without building the layout (milliseconds instead of
  seconds for big MoE models): the strategy advisor screens hundreds of strategies
  this way. Tests check ``census_of(megatron_layout(m, d)) == megatron_census(m, d)``
  (and the FSDP2 pair) on every published config and on drawn tiny models, so the
  two cannot drift apart.

Groups are sorted (mesh axes, mesh sizes, presence, shape, placements), so equal
layouts give equal censuses whatever their tensor order. The group records
(:class:`TensorGroup`, :class:`LayerGroup`) are in :mod:`areal_fn.plans.advisor.census_groups`.
"""

import math
from collections.abc import Callable, Iterable

import attrs

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import Fsdp2Options, fsdp2_mesh, memory_sharding
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import (
    MegatronMeshes,
    default_stages,
    final_norm_chunk,
    layer_parameters,
)
from areal_fn.layouts.vocab import padded_vocab_size, vocab_tensors
from areal_fn.model.hf_memory import hf_memory_view
from areal_fn.model.linear_attention import is_linear_layer
from areal_fn.model.spec import ModelSpec, layer_of
from areal_fn.pipeline.partition import StagePlan
from areal_fn.plans.advisor.census_groups import LayerGroup as LayerGroup
from areal_fn.plans.advisor.census_groups import Presence as Presence
from areal_fn.plans.advisor.census_groups import TensorGroup as TensorGroup
from areal_fn.plans.advisor.census_groups import _group_key, _layer_key
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding, local_shape
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.rules import check_dims
from areal_fn.typecheck import beartype

_FSDP2_DEFAULTS = Fsdp2Options()

__all__ = [
    "DATA_PARALLEL_AXES",
    "Census",
    "CensusIndex",
    "LayerGroup",
    "RankShare",
    "TensorGroup",
    "census_of",
    "fsdp2_census",
    "megatron_census",
    "rank_share",
]


def _sorted_groups(value: Iterable[TensorGroup]) -> tuple[TensorGroup, ...]:
    return tuple(sorted(value, key=_group_key))


def _sorted_layers(value: Iterable[LayerGroup]) -> tuple[LayerGroup, ...]:
    return tuple(sorted(value, key=_layer_key))


@attrs.frozen(kw_only=True)
class Census:
    """A layout reduced to what memory depends on (see the module docstring).

    ``kind`` is the layout's kind (``megatron``, ``fsdp2``, ``inference``...), which
    decides how gradients and optimizer state are held; ``world_size`` its ranks.
    """

    kind: str
    world_size: int
    groups: tuple[TensorGroup, ...] = attrs.field(converter=_sorted_groups)
    layers: tuple[LayerGroup, ...] = attrs.field(default=(), converter=_sorted_layers)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.world_size, bool) or self.world_size < 1:
            raise SpecError(f"Census.world_size={self.world_size!r} must be an int >= 1")
        keys = [_group_key(g) for g in self.groups]
        for g in self.groups:
            if g.sharding.mesh.size != self.world_size:
                raise SpecError(
                    f"Census: a group's mesh {g.sharding.mesh} has {g.sharding.mesh.size} ranks, "
                    f"the census {self.world_size}; every mesh must cover the whole world"
                )
        if len(set(keys)) != len(keys):
            raise SpecError(
                "Census has two groups with one (shape, sharding, presence); merge them"
            )

    @property
    def num_tensors(self) -> int:
        """Logical tensors counted (the layout's ``len(tensors)``)."""
        return sum(g.count for g in self.groups)

    @property
    def meshes(self) -> tuple[Mesh, ...]:
        """The distinct meshes of the groups and layer groups, in sorted order."""
        out: list[Mesh] = []
        for m in [g.sharding.mesh for g in self.groups] + [g.mesh for g in self.layers]:
            if m not in out:
                out.append(m)
        return tuple(out)


class _Builder:
    """Counts groups and layers, then freezes them into a :class:`Census`.

    Shardings and meshes are interned (hashed once) so that counting stays cheap.
    """

    def __init__(self) -> None:
        self.shardings: list[Sharding] = []
        self.meshes: list[Mesh] = []
        self._ids: dict[object, int] = {}
        self.counts: dict[tuple[tuple[int, ...], int, Presence], int] = {}
        self.layers: dict[tuple[int, Presence], set[int]] = {}

    def intern(self, value: Sharding | Mesh, into: "list[Sharding] | list[Mesh]") -> int:
        key = (type(value), value)
        if key not in self._ids:
            self._ids[key] = len(into)
            into.append(value)  # type: ignore[arg-type]
        return self._ids[key]

    def add(self, shape: tuple[int, ...], sharding: int, present: Presence, count: int = 1) -> None:
        """Count ``count`` tensors of ``shape`` with interned sharding ``sharding``."""
        key = (shape, sharding, present)
        self.counts[key] = self.counts.get(key, 0) + count

    def add_layers(self, mesh: int, present: Presence, layers: Iterable[int]) -> None:
        self.layers.setdefault((mesh, present), set()).update(layers)

    def build(self, kind: str, world_size: int) -> Census:
        return Census(
            kind=kind,
            world_size=world_size,
            groups=[
                TensorGroup(shape=s, sharding=self.shardings[sh], present=p, count=n)
                for (s, sh, p), n in self.counts.items()
            ],
            layers=[
                LayerGroup(mesh=self.meshes[m], present=p, layers=ls)
                for (m, p), ls in self.layers.items()
                if ls
            ],
        )


@beartype
def census_of(layout: Layout) -> Census:
    """The census of ``layout``: its logical tensors counted by (shape, sharding, presence),
    and, per (mesh, presence), the decoder layers its tensors draw from."""
    b = _Builder()
    for t in layout.tensors:
        b.add(t.shape, b.intern(t.sharding, b.shardings), t.present)
        found = {layer_of(f.canonical) for f in t.fusion}
        mesh = b.intern(t.sharding.mesh, b.meshes)
        b.add_layers(mesh, t.present, (i for i in found if i is not None))
    return b.build(layout.kind, layout.world_size)


@beartype
def megatron_census(
    model: ModelSpec,
    dims: ParallelDims,
    *,
    stages: StagePlan | None = None,
    vocab_divisible_by: int = 128,
) -> Census:
    """``census_of(megatron_layout(model, dims, stages=stages, ...))`` without the layout.

    Same checks and errors as :func:`~areal_fn.layouts.megatron.megatron_layout` (names
    and ``grouped_gemm`` do not change a census).
    """
    check_dims(model, "megatron", dims)
    plan = stages if stages is not None else default_stages(model, dims)
    if plan.num_layers != model.num_layers or plan.num_stages != dims.pp or plan.vpp != dims.vpp:
        raise LayoutError(
            f"stage plan covers {plan.num_layers} layers in {plan.num_stages} stages x vpp "
            f"{plan.vpp}, but the model has {model.num_layers} layers and the strategy "
            f"pp={dims.pp}, vpp={dims.vpp}"
        )
    meshes = MegatronMeshes.of(dims)
    dense, expert = meshes.dense, meshes.expert
    b = _Builder()
    r: Placement = Replicate()

    def on(mesh: Mesh, p: Placement) -> int:
        return b.intern(Sharding(mesh=mesh, placements=(r, r, r, p)), b.shardings)

    rep, s0 = on(dense, r), on(dense, Shard(dim=0))
    dense_id, expert_id = b.intern(dense, b.meshes), b.intern(expert, b.meshes)
    h = model.hidden_size
    vpad = padded_vocab_size(model.vocab_size, tp=dims.tp, divisible_by=vocab_divisible_by)
    per_rank = model.num_experts // dims.ep if model.is_moe else 0
    # the family's table, once per layer kind (every layer of a kind has the same
    # parameters): dense or MoE, full or linear attention
    kind_of = [(model.moe_layers[i], is_linear_layer(model, i)) for i in range(model.num_layers)]
    kinds = {k: layer_parameters(model, kind_of.index(k)) for k in dict.fromkeys(kind_of)}
    for chunk in range(plan.num_chunks):
        pres: Presence = (("pp", chunk % dims.pp),)
        layers = list(plan.chunk_layers(chunk))
        if chunk == 0:
            b.add((vpad, h), s0, pres)
        if layers:
            b.add_layers(dense_id, pres, layers)
        for (moe, linear), rows in kinds.items():
            n = sum(kind_of[i] == (moe, linear) for i in layers)
            if not n:
                continue
            for rec, shape in rows:
                if not rec.expert:
                    b.add(shape, on(dense, rec.tp), pres, n)
                    continue
                for ep_rank in range(dims.ep):
                    b.add(shape, on(expert, rec.tp), (*pres, ("ep", ep_rank)), per_rank * n)
            if moe:
                moe_layers = [i for i in layers if model.moe_layers[i]]
                for ep_rank in range(dims.ep):
                    b.add_layers(expert_id, (*pres, ("ep", ep_rank)), moe_layers)
        if chunk == final_norm_chunk(model, plan):
            b.add((h,), rep, pres)
        if chunk == plan.num_chunks - 1:
            if model.mtp_layers and chunk > 0:  # the MTP block's copy of the embedding
                b.add((vpad, h), s0, pres)
            if not model.tie_word_embeddings or dims.pp > 1:
                b.add((vpad, h), s0, pres)
            _mtp_census(b, model, dims, pres, on, dense_id, expert_id)
    return b.build("megatron", dense.size)


def _mtp_census(
    b: "_Builder",
    model: ModelSpec,
    dims: ParallelDims,
    pres: Presence,
    on: "Callable[[Mesh, Placement], int]",
    dense_id: int,
    expert_id: int,
) -> None:
    """The MTP block of the last chunk (its tied embedding and head add no tensor)."""
    if not model.mtp_layers:
        return
    h, meshes = model.hidden_size, MegatronMeshes.of(dims)
    mtp = list(model.mtp_layer_ids)
    n = len(mtp)
    b.add((h,), on(meshes.dense, Replicate()), pres, 3 * n)  # enorm, hnorm, final_layernorm
    b.add((h, 2 * h), on(meshes.dense, Shard(dim=0)), pres, n)  # eh_proj
    per_rank = model.num_experts // dims.ep if model.is_moe else 0
    for rec, shape in layer_parameters(model, mtp[0]):
        if not rec.expert:
            b.add(shape, on(meshes.dense, rec.tp), pres, n)
            continue
        for ep_rank in range(dims.ep):
            b.add(shape, on(meshes.expert, rec.tp), (*pres, ("ep", ep_rank)), per_rank * n)
    b.add_layers(dense_id, pres, mtp)
    if model.family.moe:
        for ep_rank in range(dims.ep):
            b.add_layers(expert_id, (*pres, ("ep", ep_rank)), mtp)


@beartype
def fsdp2_census(
    model: ModelSpec, dims: ParallelDims, *, options: Fsdp2Options = _FSDP2_DEFAULTS
) -> Census:
    """``census_of(fsdp2_layout(model, dims, options=options))`` without the layout.

    Same checks and errors as :func:`~areal_fn.layouts.fsdp2.fsdp2_layout`. Experts are
    counted as transformers 5 holds them: one stacked tensor per fused group per layer.
    """
    check_dims(
        model,
        "fsdp2",
        dims,
        tp_embeddings=options.tp_embeddings,
        hsdp_replicas=options.hsdp_replicas,
    )
    mesh = fsdp2_mesh(dims, options)
    b = _Builder()
    replicated = b.intern(Sharding.replicated(mesh), b.shardings)
    vocab = vocab_tensors(model)
    for mt in hf_memory_view(model):
        if model.tie_word_embeddings and mt.name == model.family.outer.output:
            continue  # the same Parameter as the embedding
        sharding = (  # a buffer stays whole on every rank, as in fsdp2_layout
            replicated
            if mt.buffer
            else b.intern(
                memory_sharding(model, mt, dims, mesh, options, vocab=mt.name in vocab),
                b.shardings,
            )
        )
        b.add(mt.shape, sharding, ())
    b.add_layers(b.intern(mesh, b.meshes), (), range(model.num_layers))
    return b.build("fsdp2", mesh.size)


# -- per-rank queries -----------------------------------------------------------------

#: Mesh axes whose replicas form a data-parallel group (gradients are reduced over
#: them; Megatron's distributed optimizer shards optimizer state over them).
DATA_PARALLEL_AXES = ("dp", "cp", "edp")


@attrs.frozen(kw_only=True)
class RankShare:
    """What one rank holds of a census.

    ``by_dp_group``: local elements by the size of the data-parallel group they are
    replicated over, ``((group size, numel), ...)`` ascending (size 1: no rank shares
    them); ``tensors``: local tensors; ``layers``: decoder layers present.
    """

    rank: int
    by_dp_group: tuple[tuple[int, int], ...]
    tensors: int
    layers: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.by_dp_group)


def _dp_size(sharding: Sharding, present: Presence) -> int:
    """Ranks of the data-parallel group a tensor is replicated over (axes in
    :data:`DATA_PARALLEL_AXES` where it is ``Replicate`` and not pinned by presence)."""
    mesh = sharding.mesh
    fixed = {a for a, _ in present}
    return math.prod(
        s
        for n, s, p in zip(mesh.names, mesh.sizes, sharding.placements, strict=True)
        if n in DATA_PARALLEL_AXES and n not in fixed and isinstance(p, Replicate)
    )


class CensusIndex:
    """A census indexed for per-rank queries (:meth:`share`, :meth:`key`).

    Groups are bucketed by (mesh, presence axes) and looked up by the rank's
    coordinates, so a query touches only the groups present on the rank; local numels
    are cached by the coordinates on the axes that shard a tensor.
    """

    def __init__(self, census: Census) -> None:
        self.census = census
        self.meshes = census.meshes
        mesh_ids = {m: i for i, m in enumerate(self.meshes)}
        relevant: list[set[int]] = [set() for _ in self.meshes]
        sharding_ids: dict[Sharding, int] = {}
        # (mesh, presence axes) -> presence coordinates -> [(sharding id, shape, count, dp, sharding)]
        self._groups: dict[
            tuple[int, tuple[int, ...]],
            dict[tuple[int, ...], list[tuple[int, tuple[int, ...], int, int, Sharding]]],
        ] = {}
        self._shard_axes: list[tuple[int, ...]] = []
        for g in census.groups:
            mesh = g.sharding.mesh
            i = mesh_ids[mesh]
            if g.sharding not in sharding_ids:
                sharding_ids[g.sharding] = len(sharding_ids)
                self._shard_axes.append(
                    tuple(
                        j
                        for j, p in enumerate(g.sharding.placements)
                        if isinstance(p, Shard | StridedShard)
                    )
                )
            sid = sharding_ids[g.sharding]
            axes = tuple(mesh.axis_index(a) for a, _ in g.present)
            relevant[i].update(self._shard_axes[sid], axes)
            bucket = self._groups.setdefault((i, axes), {})
            bucket.setdefault(tuple(c for _, c in g.present), []).append(
                (sid, g.shape, g.count, _dp_size(g.sharding, g.present), g.sharding)
            )
        self._layers: dict[tuple[int, tuple[int, ...]], dict[tuple[int, ...], set[int]]] = {}
        for lg in census.layers:
            i = mesh_ids[lg.mesh]
            axes = tuple(lg.mesh.axis_index(a) for a, _ in lg.present)
            relevant[i].update(axes)
            bucket_l = self._layers.setdefault((i, axes), {})
            bucket_l.setdefault(tuple(c for _, c in lg.present), set()).update(lg.layers)
        self.relevant = tuple(tuple(sorted(s)) for s in relevant)
        self._numel: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}

    def coords(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """``rank``'s coordinates on every mesh of the census."""
        out = []
        for mesh in self.meshes:
            c, r = [], rank
            for s in reversed(mesh.sizes):
                c.append(r % s)
                r //= s
            out.append(tuple(reversed(c)))
        return tuple(out)

    def key(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """Ranks with equal keys hold equal numels of every group and the same layers."""
        return tuple(
            tuple(c[j] for j in rel)
            for c, rel in zip(self.coords(rank), self.relevant, strict=True)
        )

    def share(self, rank: int) -> RankShare:
        """What ``rank`` holds: elements by data-parallel group size, tensors, layers."""
        if not 0 <= rank < self.census.world_size:
            raise SpecError(
                f"rank={rank} is outside this {self.census.kind} census of "
                f"{self.census.world_size} ranks; use 0..{self.census.world_size - 1}"
            )
        coords = self.coords(rank)
        by_dp: dict[int, int] = {}
        tensors = 0
        for (i, axes), bucket in self._groups.items():
            c = coords[i]
            for sid, shape, count, dp, sharding in bucket.get(tuple(c[a] for a in axes), ()):
                k = (sid, shape, tuple(c[j] for j in self._shard_axes[sid]))
                if k not in self._numel:
                    self._numel[k] = math.prod(local_shape(shape, sharding, rank))
                by_dp[dp] = by_dp.get(dp, 0) + self._numel[k] * count
                tensors += count
        layers: set[int] = set()
        for (i, axes), bucket_l in self._layers.items():
            c = coords[i]
            layers.update(bucket_l.get(tuple(c[a] for a in axes), ()))
        return RankShare(
            rank=rank,
            by_dp_group=tuple(sorted(by_dp.items())),
            tensors=tensors,
            layers=tuple(sorted(layers)),
        )

    def stage(self, rank: int) -> int:
        """``rank``'s coordinate on a ``pp`` mesh axis (0 when no mesh has one)."""
        for mesh, c in zip(self.meshes, self.coords(rank), strict=True):
            if "pp" in mesh.names:
                return c[mesh.names.index("pp")]
        return 0


@beartype
def rank_share(census: Census, rank: int) -> RankShare:
    """What ``rank`` holds of ``census`` (see :class:`RankShare`)."""
    return CensusIndex(census).share(rank)
