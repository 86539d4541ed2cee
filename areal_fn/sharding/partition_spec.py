"""JAX-style partition specs <-> `Sharding`.

A ``PartitionSpec`` has one entry per tensor dim: the mesh axes that shard it, major
to minor (``()`` = not sharded). Listing axes against mesh order is right-to-left
sharding, which DTensor spells ``StridedShard``: ``PartitionSpec.of(("tp", "dp"))``
on ``Mesh.of(dp=2, tp=4)`` is ``(StridedShard(0, split_factor=4), Shard(0))`` - the
FSDP2-over-TP layout. Geometry agrees with JAX when every sharded dim divides evenly.
A spec cannot express ``Partial`` nor a ``StridedShard`` whose split factor is not a
product of other axes' sizes: converting those raises ``SpecError``.
"""

import itertools
from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Partial, Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding
from areal_fn.typecheck import beartype


def _entries(value: object) -> tuple[tuple[str, ...], ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise SpecError(
            f"PartitionSpec.entries={value!r} must be a sequence with one entry per tensor dim"
        )
    out: list[tuple[str, ...]] = []
    for i, e in enumerate(value):
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        elif isinstance(e, Sequence) and all(isinstance(a, str) for a in e):
            out.append(tuple(e))
        else:
            raise SpecError(
                f"PartitionSpec entry {i}={e!r} must be None, an axis name or a tuple of axis names"
            )
    return tuple(out)


def _check_unique(_inst: object, _attr: object, entries: tuple[tuple[str, ...], ...]) -> None:
    seen: set[str] = set()
    for e in entries:
        for a in e:
            if a in seen:
                raise SpecError(
                    f"PartitionSpec {entries!r} uses mesh axis {a!r} twice; each axis shards at most one dim"
                )
            seen.add(a)


@attrs.frozen(kw_only=True)
class PartitionSpec:
    """``PartitionSpec.of("dp", None, ("tp", "cp"))``: one entry per tensor dim."""

    entries: tuple[tuple[str, ...], ...] = attrs.field(converter=_entries, validator=_check_unique)

    @classmethod
    def of(cls, *entries: "str | Sequence[str] | None") -> "PartitionSpec":
        return cls(entries=entries)

    def __str__(self) -> str:
        def one(e: tuple[str, ...]) -> str:
            return (
                "None"
                if not e
                else (repr(e[0]) if len(e) == 1 else "(" + ", ".join(map(repr, e)) + ")")
            )

        return "P(" + ", ".join(one(e) for e in self.entries) + ")"


def _placements_for(mesh: Mesh, entries: tuple[tuple[str, ...], ...]) -> tuple[Placement, ...]:
    out: list[Placement] = [Replicate() for _ in mesh.names]
    for d, axes in enumerate(entries):
        idx = [mesh.axis_index(a) for a in axes]
        for pos, m in enumerate(idx):
            sf = 1
            for earlier in idx[:pos]:
                if earlier > m:
                    sf *= mesh.sizes[earlier]
            out[m] = Shard(dim=d) if sf == 1 else StridedShard(dim=d, split_factor=sf)
    return tuple(out)


@beartype
def from_partition_spec(spec: PartitionSpec, mesh: Mesh) -> Sharding:
    """The `Sharding` equivalent to ``spec`` on ``mesh`` (unnamed axes replicate)."""
    for axes in spec.entries:
        for a in axes:
            if a not in mesh.names:
                raise SpecError(
                    f"{spec} names mesh axis {a!r}, which {mesh} does not have; use one of {mesh.names!r}"
                )
    return Sharding(mesh=mesh, placements=_placements_for(mesh, spec.entries))


@beartype
def to_partition_spec(sharding: Sharding, ndim: int) -> PartitionSpec:
    """The JAX-style spec of ``sharding`` for an ``ndim``-dim tensor, when lossless."""
    mesh = sharding.mesh
    for name, p in zip(mesh.names, sharding.placements, strict=True):
        if isinstance(p, Partial):
            raise SpecError(
                f"{sharding}: Partial(op={p.op!r}) on mesh axis {name!r} has no PartitionSpec form; "
                "reduce it (unshard or redistribute to Replicate) before converting"
            )
        if isinstance(p, (Shard, StridedShard)) and p.dim >= ndim:
            raise SpecError(
                f"{sharding}: {p!r} on axis {name!r} shards dim {p.dim} of a {ndim}-dim tensor"
            )
    entries: list[tuple[str, ...]] = []
    for d in range(ndim):
        axes = sharding.axes_sharding(d)
        want = tuple(sharding.placements[i] for i in axes)
        found = None
        for perm in itertools.permutations(axes):
            names = tuple(mesh.names[i] for i in perm)
            got = _placements_for(mesh, ((),) * d + (names,))
            if tuple(got[i] for i in axes) == want:
                found = names
                break
        if found is None:
            raise SpecError(
                f"{sharding}: the placements on dim {d} "
                f"({', '.join(f'{mesh.names[i]}:{sharding.placements[i]}' for i in axes)}) are not a "
                "major-to-minor order of mesh axes, so no PartitionSpec expresses them; a StridedShard's "
                "split_factor must equal the product of the sizes of the later axes listed before it"
            )
        entries.append(found)
    return PartitionSpec(entries=tuple(entries))
