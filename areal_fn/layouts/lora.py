"""LoRA adapters in any layout: placed beside the base layer that holds their weight.

:func:`with_lora` adds to a layout (FSDP2, Megatron, inference, vLLM) the adapter
tensors of :mod:`areal_fn.model.lora` as logical tensors, so that conversion, transfer
plans, checkpoints and memory see them like any other tensor. For a base logical
tensor ``W`` (``[out, in]``, possibly fused) that holds targeted weights:

- ``<W's name stem>.lora_A.weight``: the members' ``lora_A`` stacked in the order the
  fusion map first meets them, ``[k * r, in]`` for ``k`` fused members (PEFT's
  ``lora_A`` itself when ``W`` is one weight);
- ``<W's name stem>.lora_B.weight``: ``[out, r]``, its rows laid out exactly like
  ``W``'s (Megatron's ``linear_qkv`` interleaves q/k/v rows per query group, and so
  does its ``lora_B``; ``linear_fc1`` is ``[gate; up]``, and so is its ``lora_B``). The
  rows of member ``i`` are computed from rows ``i*r .. (i+1)*r`` of ``lora_A x``, so the
  fused pair computes what PEFT's separate adapters compute, and converting to and from
  PEFT's tensors is a copy of boxes (bitwise).

Placements, per mesh axis, from ``W``'s: a split of ``W``'s rows (column parallel:
q/k/v/gate/up) splits ``lora_B``'s rows alike and replicates ``lora_A``; a split of
``W``'s columns (row parallel: o/down) splits ``lora_A``'s columns alike and replicates
``lora_B``; on FSDP2's ``dp_shard`` axis both are sharded on dim 0 like every other
parameter (``lora_B`` exactly like ``W``, ``lora_A`` ``Shard(0)``).

Refused (``LayoutError``): a fused tensor holding targeted and untargeted weights, or
members of different ranks; a weight split over several logical tensors; pieces that
are strided, tied, stacked or cut in the input dimension.

Routed experts (``LoraConfig.target_parameters``): in an FSDP2 layout, beside
transformers' fused expert tensor (``mlp.experts.gate_up_proj`` ``[E, out, in]``),
``<its name>_lora_A`` and ``<its name>_lora_B`` are PEFT's pair itself (``[E * r, in]``,
``[out, E * r]``), replicated where the base is and sharded on dim 0 over
``dp_shard``. In a Megatron layout each local expert's ``linear_fc1`` / ``linear_fc2``
gets expert ``e``'s part of PEFT's pair, like any linear layer: rows ``e*r..(e+1)*r`` of
``lora_A`` and columns ``e, e+E, ..., e+(r-1)E`` of ``lora_B`` (a strided view), its
rows laid out like the base's (``[gate; up]`` for ``linear_fc1``). Other layout kinds
are refused.
"""

from collections.abc import Sequence

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece, Layout, LayoutKind, LogicalTensor
from areal_fn.model.lora import (
    LoraConfig,
    LoraExpertTarget,
    LoraTarget,
    lora_expert_targets,
    lora_targets,
    lora_tensors,
)
from areal_fn.model.spec import ModelSpec
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Axis
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding
from areal_fn.sharding.strided import View
from areal_fn.typecheck import beartype

__all__ = [
    "adapter_layout",
    "adapter_row_members",
    "adapter_shardings",
    "expert_kind_error",
    "with_lora",
]


def _rows_dim0(p: Placement) -> bool:
    return isinstance(p, Shard | StridedShard) and p.dim == 0


@beartype
def adapter_shardings(name: str, base: Sharding) -> tuple[Sharding, Sharding]:
    """``(lora_A, lora_B)`` shardings of the adapters of base tensor ``name`` sharded ``base``."""
    a: list[Placement] = []
    b: list[Placement] = []
    for axis, p in zip(base.mesh.names, base.placements, strict=True):
        if isinstance(p, Replicate):
            a.append(p)
            b.append(p)
        elif axis == Axis.DP_SHARD and _rows_dim0(p):
            a.append(Shard(dim=0))
            b.append(p)
        elif _rows_dim0(p):
            a.append(Replicate())
            b.append(p)
        elif isinstance(p, Shard) and p.dim == 1:
            a.append(p)
            b.append(Replicate())
        else:
            raise LayoutError(
                f"{name}: placement {p} on axis {axis!r} is neither a split of the rows nor of the "
                "columns of a linear weight; LoRA adapters cannot be placed beside it"
            )
    return (
        Sharding(mesh=base.mesh, placements=tuple(a)),
        Sharding(mesh=base.mesh, placements=tuple(b)),
    )


def _stem(name: str) -> str:
    return name.removesuffix(".weight")


def _members(t: LogicalTensor, targets: dict[str, LoraTarget]) -> list[LoraTarget]:
    """The targets ``t`` holds, in fusion order; refusals for the forms not modelled."""
    names: list[str] = []
    for f in t.fusion:
        if f.canonical not in names and not f.tied:
            names.append(f.canonical)
    found = [targets[n] for n in names if n in targets]
    if not found:
        return []
    other = [n for n in names if n not in targets]
    if other:
        raise LayoutError(
            f"{t.name} fuses {names}; LoRA targets {[m.base for m in found]} of them but not "
            f"{other}: target all of its modules or none"
        )
    ranks = {m.rank for m in found}
    if len(ranks) > 1:
        raise LayoutError(
            f"{t.name} fuses {names} whose adapters have ranks {[m.rank for m in found]}; a fused "
            "tensor's adapters share one rank: give its modules one rank (module_ranks)"
        )
    cols = found[0].in_features
    if len(t.shape) != 2 or t.shape[1] != cols:
        raise LayoutError(
            f"{t.name} has shape {t.shape}, not [rows, {cols}]; LoRA is placed beside 2-D "
            "linear weights only"
        )
    for f in t.fusion:
        if f.view is not None or f.tied or f.stacked_dims:
            raise LayoutError(
                f"{t.name}: a strided, tied or stacked piece of {f.canonical}; not LoRA-able"
            )
        if f.canonical_box.ranges[1] != (0, cols) or f.logical_box.ranges[1] != (0, cols):
            raise LayoutError(
                f"{t.name}: its piece of {f.canonical} covers columns {f.canonical_box.ranges[1]} "
                f"of {cols}; LoRA needs whole input rows"
            )
    return found


def _adapters(t: LogicalTensor, members: Sequence[LoraTarget]) -> tuple[LogicalTensor, ...]:
    r, cols = members[0].rank, members[0].in_features
    a_name = {m.base: m.lora_a for m in members}
    b_name = {m.base: m.lora_b for m in members}
    a_fusion = tuple(
        FusionPiece(
            canonical=m.lora_a,
            canonical_box=Box.full((r, cols)),
            logical_box=Box(ranges=((i * r, (i + 1) * r), (0, cols))),
        )
        for i, m in enumerate(members)
    )
    b_fusion = tuple(
        FusionPiece(
            canonical=b_name[f.canonical],
            canonical_box=Box(ranges=(f.canonical_box.ranges[0], (0, r))),
            logical_box=Box(ranges=(f.logical_box.ranges[0], (0, r))),
        )
        for f in t.fusion
        if f.canonical in a_name
    )
    sa, sb = adapter_shardings(t.name, t.sharding)
    stem = _stem(t.name)
    return (
        LogicalTensor(
            name=stem + ".lora_A.weight",
            shape=(len(members) * r, cols),
            dtype=members[0].tensors[0].dtype,
            fusion=a_fusion,
            sharding=sa,
            present=t.present,
        ),
        LogicalTensor(
            name=stem + ".lora_B.weight",
            shape=(t.shape[0], r),
            dtype=members[0].tensors[1].dtype,
            fusion=b_fusion,
            sharding=sb,
            present=t.present,
        ),
    )


def _expert_sharding(name: str, base: Sharding) -> Sharding:
    out: list[Placement] = []
    for axis, p in zip(base.mesh.names, base.placements, strict=True):
        if isinstance(p, Replicate) or (axis == Axis.DP_SHARD and p == Shard(dim=0)):
            out.append(p)
        else:
            raise LayoutError(
                f"{name}: placement {p} on axis {axis!r}; expert adapters are placed beside "
                "fused experts that are replicated, or sharded on the expert dim over "
                "dp_shard, only: drop target_parameters for this layout"
            )
    return Sharding(mesh=base.mesh, placements=tuple(out))


def _expert_adapters(t: LogicalTensor, x: LoraExpertTarget) -> tuple[LogicalTensor, ...]:
    """PEFT's pair of fused expert tensor ``t`` (checked to hold ``x.parts`` whole)."""
    held = [f.canonical for f in t.fusion if f.canonical is not None]
    if t.shape != (x.experts, x.out_features, x.in_features) or sorted(held) != sorted(x.parts):
        raise LayoutError(
            f"{t.name} has shape {t.shape} and holds {len(held)} pieces; expert adapters "
            f"need it to hold {x.parts[0]} .. {x.parts[-1]} whole as "
            f"[{x.experts}, {x.out_features}, {x.in_features}]"
        )
    sharding = _expert_sharding(t.name, t.sharding)
    out = []
    for suffix, spec in zip(("_lora_A", "_lora_B"), x.tensors, strict=True):
        piece = FusionPiece(
            canonical=spec.name,
            canonical_box=Box.full(spec.shape),
            logical_box=Box.full(spec.shape),
        )
        out.append(
            LogicalTensor(
                name=t.name + suffix,
                shape=spec.shape,
                dtype=spec.dtype,
                fusion=(piece,),
                sharding=sharding,
                present=t.present,
            )
        )
    return tuple(out)


def expert_kind_error(config: LoraConfig, kind: str) -> LayoutError:
    """The refusal of expert adapters (``target_parameters``) in a ``kind`` layout."""
    return LayoutError(
        f"target_parameters={list(config.target_parameters)}: adapters on routed experts "
        f"are placed in the training engines' layouts (fsdp2, megatron) only, and this "
        f"layout is {kind}: drop target_parameters for it"
    )


def _per_expert_adapters(
    t: LogicalTensor, x: LoraExpertTarget, e: int
) -> tuple[LogicalTensor, ...]:
    """Megatron's adapters of expert ``e``'s linear layer ``t``: rows ``e*r..(e+1)*r`` of
    PEFT's ``lora_A`` and columns ``e, e+E, ...`` of its ``lora_B`` (a strided view),
    ``lora_B``'s rows laid out like ``t``'s."""
    r, cols, per = x.rank, x.in_features, len(x.parts) // x.experts
    if len(t.shape) != 2 or t.shape[1] != cols:
        raise LayoutError(f"{t.name} has shape {t.shape}, not [rows, {cols}]; not LoRA-able")
    offset, row = {}, 0
    for name in x.parts[e * per : (e + 1) * per]:
        offset[name] = row
        row += x.out_features // per
    a = FusionPiece(
        canonical=x.lora_a,
        canonical_box=Box(ranges=((e * r, (e + 1) * r), (0, cols))),
        logical_box=Box.full((r, cols)),
    )
    b = []
    for f in t.fusion:
        if f.view is not None or f.tied or f.stacked_dims or f.canonical_box.ranges[1] != (0, cols):
            raise LayoutError(f"{t.name}: a strided, tied, stacked or cut piece of {f.canonical}")
        lo, hi = f.canonical_box.ranges[0]
        b.append(
            FusionPiece(
                canonical=x.lora_b,
                canonical_box=Box(
                    ranges=(
                        (offset[f.canonical] + lo, offset[f.canonical] + hi),
                        (e, e + x.experts * (r - 1) + 1),
                    )
                ),
                logical_box=Box(ranges=(f.logical_box.ranges[0], (0, r))),
                view=View(step=(1, x.experts), perm=(0, 1)),
            )
        )
    sa, sb = adapter_shardings(t.name, t.sharding)
    stem = _stem(t.name)
    a_spec, b_spec = x.tensors
    return (
        LogicalTensor(
            name=stem + ".lora_A.weight",
            shape=(r, cols),
            dtype=a_spec.dtype,
            fusion=(a,),
            sharding=sa,
            present=t.present,
        ),
        LogicalTensor(
            name=stem + ".lora_B.weight",
            shape=(t.shape[0], r),
            dtype=b_spec.dtype,
            fusion=tuple(b),
            sharding=sb,
            present=t.present,
        ),
    )


def _megatron_experts(
    layout: Layout, targets: Sequence[LoraExpertTarget]
) -> list[tuple[int, tuple[LogicalTensor, ...]]]:
    """Every local expert's ``linear_fc1`` / ``linear_fc2`` holding targeted weights."""
    part: dict[str, tuple[LoraExpertTarget, int]] = {}
    for x in targets:
        per = len(x.parts) // x.experts
        for k, name in enumerate(x.parts):
            part[name] = (x, k // per)
    out, seen = [], set()
    for i, t in enumerate(layout.tensors):
        names = [f.canonical for f in t.fusion if f.canonical is not None]
        if not names or names[0] not in part:
            continue
        x, e = part[names[0]]
        per = len(x.parts) // x.experts
        if sorted(set(names)) != sorted(x.parts[e * per : (e + 1) * per]):
            raise LayoutError(
                f"{t.name} holds {names}, not exactly expert {e}'s "
                f"{list(x.parts[e * per : (e + 1) * per])}; expert adapters cannot be placed"
            )
        seen.update(names)
        out.append((i, _per_expert_adapters(t, x, e)))
    lost = [n for n in part if n not in seen]
    if lost:
        raise LayoutError(f"expert weights {lost[:3]} are held by no tensor of this layout")
    return out


def _expert_tensors(
    layout: Layout, model: ModelSpec, config: LoraConfig
) -> list[tuple[int, tuple[LogicalTensor, ...]]]:
    """(index of the expert tensor, its adapters), in layout order."""
    targets = lora_expert_targets(model, config)
    if not targets:
        return []
    if layout.kind == LayoutKind.MEGATRON:
        return _megatron_experts(layout, targets)
    if layout.kind != LayoutKind.FSDP2:
        raise expert_kind_error(config, str(layout.kind))
    index = {t.name: i for i, t in enumerate(layout.tensors)}
    out = []
    for x in targets:
        if x.base not in index:
            raise LayoutError(
                f"expert adapter target {x.base} is not a tensor of this {layout.kind} layout; "
                "pass the model the layout was built from"
            )
        i = index[x.base]
        out.append((i, _expert_adapters(layout.tensors[i], x)))
    return out


def _adapter_tensors(
    layout: Layout, model: ModelSpec, config: LoraConfig
) -> list[tuple[int, tuple[LogicalTensor, ...]]]:
    """(index of the base logical tensor, its adapters), in layout order."""
    experts = _expert_tensors(layout, model, config)  # its refusals first
    targets = {t.base: t for t in lora_targets(model, config)}
    known = {c.name for c in layout.canonical}
    absent = [n for n in targets if n not in known]
    if absent:
        raise LayoutError(
            f"LoRA targets {absent[:3]} are not canonical tensors of this {layout.kind} layout; "
            "pass the model the layout was built from"
        )
    held: dict[str, str] = {}
    out = []
    for i, t in enumerate(layout.tensors):
        members = _members(t, targets)
        for m in members:
            if m.base in held:
                raise LayoutError(
                    f"{m.base} is held by {held[m.base]} and {t.name}; LoRA adapters are placed "
                    "beside a weight one logical tensor holds"
                )
            held[m.base] = t.name
        if members:
            out.append((i, _adapters(t, members)))
    lost = [n for n in targets if n not in held]
    if lost:
        raise LayoutError(
            f"LoRA targets {lost[:3]} are held by no tensor of this {layout.kind} layout"
        )
    return out + experts


@beartype
def with_lora(layout: Layout, model: ModelSpec, config: LoraConfig) -> Layout:
    """``layout`` with the adapters of ``config`` beside their base tensors (each base tensor
    followed by its ``lora_A`` and ``lora_B``; canonical tensors: the model's, then the
    adapters in checkpoint order). ``model`` is the one ``layout`` was built from."""
    adapters = dict(_adapter_tensors(layout, model, config))
    tensors: list[LogicalTensor] = []
    for i, t in enumerate(layout.tensors):
        tensors.append(t)
        tensors.extend(adapters.get(i, ()))
    specs = lora_tensors(model, config)
    return Layout(
        kind=layout.kind,
        world_size=layout.world_size,
        canonical=layout.canonical + specs,
        tensors=tuple(tensors),
        stages=layout.stages,
    )


@beartype
def adapter_layout(layout: Layout, model: ModelSpec, config: LoraConfig) -> Layout:
    """The adapters of :func:`with_lora` alone (the trained part of a LoRA layout)."""
    pairs = sorted(_adapter_tensors(layout, model, config), key=lambda p: p[0])
    tensors = tuple(t for _, pair in pairs for t in pair)
    specs = lora_tensors(model, config)
    return Layout(
        kind=layout.kind,
        world_size=layout.world_size,
        canonical=specs,
        tensors=tensors,
        stages=layout.stages,
    )


@beartype
def adapter_row_members(layout: Layout, lora_b: str, rank: int) -> tuple[int, ...]:
    """For each local row of fused ``lora_B`` tensor ``lora_b`` on ``rank``: the member
    (``0..k-1``, the order of its ``lora_A``'s blocks) whose rows of ``lora_A x`` it
    reads. ``(0, 0, ...)`` for an adapter of one weight. Under pipeline parallelism the
    tensor is the one of ``rank``'s stage (stages reuse local layer names)."""
    a_name = lora_b.removesuffix(".lora_B.weight") + ".lora_A.weight"
    here = [t for t in layout.tensors if t.name in (a_name, lora_b) and t.is_present(rank)]
    if len(here) != 2:
        raise LayoutError(f"rank {rank} holds no {lora_b!r} in this {layout.kind} layout")
    a = next(t for t in here if t.name == a_name)
    r = next(t for t in here if t.name == lora_b).shape[1]
    member = {
        f.canonical.removesuffix(".lora_A.weight"): f.logical_box.ranges[0][0] // r
        for f in a.fusion
    }
    local = next((lt for lt in layout.local_tensors(rank) if lt.name == lora_b), None)
    if local is None:
        raise LayoutError(f"rank {rank} holds no {lora_b!r} in this {layout.kind} layout")
    rows = [-1] * local.shape[0]
    for piece in local.pieces:
        if piece.canonical is None:
            continue
        lo, hi = piece.local_box.ranges[0]
        for i in range(lo, hi):
            rows[i] = member[piece.canonical.removesuffix(".lora_B.weight")]
    if -1 in rows:
        raise LayoutError(f"{lora_b} on rank {rank}: row {rows.index(-1)} reads no adapter")
    return tuple(rows)
