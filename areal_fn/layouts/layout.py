"""Layouts: every rank's local tensors as pieces of canonical tensors.

A layout is a tuple of :class:`LogicalTensor`. A logical tensor is the tensor a
framework holds before sharding (possibly fused and padded: Megatron's
``linear_qkv``, ``linear_fc1 = [gate; up]``, a vocab-padded embedding), described by
a *fusion map* (which box of which canonical tensor sits at which logical box;
uncovered logical regions are padding), and a :class:`~areal_fn.sharding.sharding.Sharding`
of it over a mesh of the whole world, plus optional *presence* constraints (a
pipeline stage's tensors exist only on ranks with that ``pp`` coordinate).

``Layout.local_tensors(rank)`` composes the two: each local tensor is a list of
:class:`Piece` (canonical name, canonical box, local box), padding pieces having no
canonical source. Everything else (conversion, transfer plans, checkpoints, memory)
is geometry on these pieces.
"""

import enum
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from areal_fn.errors import LayoutError
from areal_fn.model.tensor_spec import TensorSpec, dtype_name
from areal_fn.pipeline.partition import StagePlan
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Replicate
from areal_fn.sharding.sharding import Sharding, check_sharding, local_pieces, local_shape
from areal_fn.sharding.strided import View, check_view, sub_box, view_shape
from areal_fn.strategy.allocation import Backend
from areal_fn.typecheck import beartype


@functools.lru_cache(maxsize=4096)
def _boxes_match(canonical: Box, logical: Box) -> bool:
    extra = logical.ndim - canonical.ndim
    return (
        extra >= 0
        and logical.shape[extra:] == canonical.shape
        and all(s == 1 for s in logical.shape[:extra])
    )


@functools.lru_cache(maxsize=4096)
def _fits(shape: tuple[int, ...], box: Box) -> bool:
    return Box.full(shape).contains(box)


def _strided_box(name: str, box: Box | None, view: View) -> Box:
    """A strided piece's canonical box, for code that reads plain boxes only: refused."""
    raise LayoutError(
        f"the piece of {name!r} at {box} is strided/transposed (view {view}: a gpt-oss expert "
        "of a Megatron layout); this code reads plain canonical boxes only. Conversion "
        "(areal_fn.plans.convert) handles such pieces; code that places boxes lifts the "
        "layout first (areal_fn.layouts.lift), as transfer and checkpoint plans do"
    )


@attrs.frozen(kw_only=True)
class FusionPiece:
    """Canonical box ``canonical_box`` of tensor ``canonical`` sits at ``logical_box``.

    With a ``view`` (:class:`~areal_fn.sharding.strided.View`) the box's elements are
    taken with a step and permuted first (gpt-oss experts under Megatron); such a piece's
    box is ``canonical_region``, and ``canonical_box`` raises ``LayoutError`` so that code
    reading plain boxes only refuses it instead of misreading it.

    A ``tied`` piece names a second canonical tensor, equal to the one of the untied
    piece at its logical box (Megatron's MTP layers share the main embedding and head):
    conversion checks the equality on the way in and copies it out; it does not count
    as covering the tensor (padding, gradient norms).
    """

    canonical: str
    canonical_region: Box = attrs.field(alias="canonical_box")
    logical_box: Box
    view: View | None = None
    tied: bool = False

    def __attrs_post_init__(self) -> None:
        if self.view is not None:
            check_view(self.canonical, self.canonical_region, self.view, self.logical_box)
        elif not _boxes_match(self.canonical_region, self.logical_box):
            raise LayoutError(
                f"fusion piece of {self.canonical!r}: canonical box {self.canonical_region} has shape "
                f"{self.canonical_region.shape} but logical box {self.logical_box} has shape "
                f"{self.logical_box.shape}; they must match element for element (a logical box may "
                "only add leading dims of extent 1, like a stacked expert)"
            )

    @property
    def canonical_box(self) -> Box:
        if self.view is not None:
            _strided_box(self.canonical, self.canonical_region, self.view)
        return self.canonical_region

    @property
    def numel(self) -> int:
        """The canonical elements the piece holds (every step-th one under a view)."""
        if self.view is None:
            return self.canonical_region.numel
        return math.prod(view_shape(self.canonical_region, self.view))

    @property
    def stacked_dims(self) -> int:
        """Leading logical dims (of extent 1) the canonical tensor does not have."""
        return self.logical_box.ndim - self.canonical_region.ndim

    def __repr__(self) -> str:
        view = "" if self.view is None else f", view={self.view!r}"
        tied = ", tied=True" if self.tied else ""
        return (
            f"FusionPiece(canonical={self.canonical!r}, canonical_box={self.canonical_region!r}, "
            f"logical_box={self.logical_box!r}{view}{tied})"
        )


@attrs.frozen(kw_only=True)
class Piece:
    """Part of a local tensor: ``canonical_box`` of ``canonical`` at ``local_box``.

    ``local_box`` may have extra leading dims of extent 1 (stacked experts): the data
    maps by reshape. With a ``view`` the canonical elements are taken with a step and
    permuted first (:mod:`areal_fn.sharding.strided`); the box is then
    ``canonical_region`` and ``canonical_box`` raises ``LayoutError`` (as for
    :class:`FusionPiece`).

    ``canonical is None`` marks padding (no canonical source; zero on load, dropped on
    export). ``tied``: as for :class:`FusionPiece` (an untied piece has its ``local_box``).
    """

    canonical: str | None
    canonical_region: Box | None = attrs.field(alias="canonical_box")
    local_box: Box
    view: View | None = None
    tied: bool = False

    @property
    def canonical_box(self) -> Box | None:
        if self.view is not None:
            _strided_box(str(self.canonical), self.canonical_region, self.view)
        return self.canonical_region

    @property
    def is_padding(self) -> bool:
        return self.canonical is None

    def local_of(self, box: Box) -> Box:
        """The local box holding canonical sub-box ``box`` (which this piece must contain)."""
        cbox = self.canonical_box
        if cbox is None:
            raise LayoutError("a padding piece holds no canonical data")
        k = self.local_box.ndim - cbox.ndim
        shifted = box.shift(
            tuple(lo - c for lo, c in zip(self.local_box.start[k:], cbox.start, strict=True))
        )
        return Box._trusted(self.local_box.ranges[:k] + shifted.ranges)

    def __repr__(self) -> str:
        view = "" if self.view is None else f", view={self.view!r}"
        tied = ", tied=True" if self.tied else ""
        return (
            f"Piece(canonical={self.canonical!r}, canonical_box={self.canonical_region!r}, "
            f"local_box={self.local_box!r}{view}{tied})"
        )


@attrs.frozen(kw_only=True)
class LocalTensor:
    """One tensor as a rank holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _presence(
    value: "Mapping[str, int] | Iterable[tuple[str, int]]",
) -> tuple[tuple[str, int], ...]:
    pairs = tuple(value.items()) if isinstance(value, Mapping) else tuple(value)
    return tuple((str(a), int(c)) for a, c in pairs)


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _fusion(value: Iterable[FusionPiece]) -> tuple[FusionPiece, ...]:
    return tuple(value)


def _specs(value: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    return tuple(value)


def _logical(value: "Iterable[LogicalTensor]") -> "tuple[LogicalTensor, ...]":
    return tuple(value)


@attrs.frozen(kw_only=True)
class LogicalTensor:
    """A framework tensor: name, shape, dtype, fusion map, sharding and presence."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    dtype: str = attrs.field(converter=dtype_name)
    fusion: tuple[FusionPiece, ...] = attrs.field(converter=_fusion)
    sharding: Sharding
    present: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_presence)

    def __attrs_post_init__(self) -> None:
        _check_tied(self.name, self.fusion)
        for f in self.fusion:
            if not _fits(self.shape, f.logical_box):
                raise LayoutError(
                    f"{self.name}: fusion piece of {f.canonical!r} at {f.logical_box} lies outside the "
                    f"logical shape {self.shape}"
                )
        try:
            check_sharding(self.shape, self.sharding)
        except Exception as e:
            raise LayoutError(f"{self.name}: {e}") from None
        mesh = self.sharding.mesh
        for axis, c in self.present:
            if axis not in mesh.names or not 0 <= c < mesh.axis_size(axis):
                raise LayoutError(
                    f"{self.name}: presence constraint {axis}={c} does not fit {mesh}; use an axis of the "
                    "mesh and a coordinate inside it"
                )
            placement = self.sharding.placements[mesh.axis_index(axis)]
            if not isinstance(placement, Replicate):
                raise LayoutError(
                    f"{self.name}: presence constraint {axis}={c} is on an axis placed {placement}; a tensor "
                    f"present at one coordinate of {axis!r} must be Replicate() on it"
                )

    @property
    def is_strided(self) -> bool:
        """Some fusion piece takes its canonical elements with a step or a transpose."""
        return any(f.view is not None for f in self.fusion)

    @property
    def is_padded(self) -> bool:
        held = sum(f.logical_box.numel for f in self.fusion if not f.tied)
        return held < Box.full(self.shape).numel

    def is_present(self, rank: int) -> bool:
        if not self.present:
            return True
        mesh = self.sharding.mesh
        coords = mesh.coords(rank)
        return all(coords[mesh.axis_index(a)] == c for a, c in self.present)

    def local(self, rank: int) -> LocalTensor | None:
        """This tensor as ``rank`` holds it, or None where it is absent."""
        if not self.is_present(rank):
            return None
        return _local(self, self.sharding.mesh.coords(rank))


def _check_tied(name: str, fusion: tuple[FusionPiece, ...]) -> None:
    """A tied piece sits at the logical box of an untied one; neither has a view."""
    untied = {f.logical_box: f for f in fusion if not f.tied}
    for f in (f for f in fusion if f.tied):
        main = untied.get(f.logical_box)
        if main is None or f.view is not None or main.view is not None:
            raise LayoutError(
                f"{name}: the tied piece of {f.canonical!r} at {f.logical_box} has no untied, "
                "unstrided piece at the same logical box to share; a tied piece names a "
                "second canonical tensor for elements another piece holds"
            )


@functools.lru_cache(maxsize=65536)
def _local_geometry(
    shape: tuple[int, ...], sharding: Sharding, rank: int
) -> tuple[tuple[int, ...], tuple[tuple[Box, Box], ...]]:
    return local_shape(shape, sharding, rank), local_pieces(shape, sharding, rank)


def _local(t: LogicalTensor, coords: tuple[int, ...]) -> LocalTensor:
    rank = t.sharding.mesh.rank(coords)
    fusion_geometry = tuple((f.canonical_region, f.logical_box, f.view, f.tied) for f in t.fusion)
    lshape, template = _local_template(t.shape, t.sharding, rank, fusion_geometry)
    names = [f.canonical for f in t.fusion]
    pieces = tuple(
        Piece(
            canonical=None if i < 0 else names[i],
            canonical_box=cbox,
            local_box=lbox,
            view=None if i < 0 else t.fusion[i].view,
            tied=i >= 0 and t.fusion[i].tied,
        )
        for i, cbox, lbox in template
    )
    return LocalTensor(name=t.name, shape=lshape, dtype=t.dtype, pieces=pieces)


@functools.lru_cache(maxsize=65536)
def _local_template(
    shape: tuple[int, ...],
    sharding: Sharding,
    rank: int,
    fusion: tuple[tuple[Box, Box, View | None, bool], ...],
) -> tuple[tuple[int, ...], tuple[tuple[int, Box | None, Box], ...]]:
    """One rank's pieces of a logical tensor, by fusion index (-1: padding).

    Keyed by geometry only, so tensors that differ in names alone (a layer's experts,
    a model's layers) share the work.
    """
    lshape, geometry = _local_geometry(shape, sharding, rank)
    out: list[tuple[int, Box | None, Box]] = []
    for gbox, lbox in geometry:
        to_local = tuple(lo - g for lo, g in zip(lbox.start, gbox.start, strict=True))
        covered = 0
        for index, (fcbox, flbox, view, tied) in enumerate(fusion):
            inter = gbox.intersect(flbox)
            if inter is None:
                continue
            covered += 0 if tied else inter.numel
            if view is not None:
                out.append((index, sub_box(fcbox, view, flbox, inter), inter.shift(to_local)))
                continue
            k = flbox.ndim - fcbox.ndim
            inner = Box._trusted(inter.ranges[k:]) if k else inter
            cbox = inner.shift(
                tuple(c - lo for c, lo in zip(fcbox.start, flbox.start[k:], strict=True))
            )
            out.append((index, cbox, inter.shift(to_local)))
        if covered < gbox.numel:
            for pad in _subtract(gbox, [flbox for _, flbox, _v, _t in fusion]):
                out.append((-1, None, pad.shift(to_local)))
    return lshape, tuple(out)


def _subtract(box: Box, holes: Sequence[Box]) -> list[Box]:
    """``box`` minus the union of ``holes``, as disjoint boxes."""
    parts = [box]
    for h in holes:
        nxt: list[Box] = []
        for p in parts:
            inter = p.intersect(h)
            if inter is None:
                nxt.append(p)
                continue
            # split p around inter, dim by dim
            rest = p
            for d in range(p.ndim):
                (lo, hi), (ilo, ihi) = rest.ranges[d], inter.ranges[d]
                if lo < ilo:
                    nxt.append(_with_range(rest, d, (lo, ilo)))
                if ihi < hi:
                    nxt.append(_with_range(rest, d, (ihi, hi)))
                rest = _with_range(rest, d, (ilo, ihi))
        parts = nxt
    return parts


def _with_range(box: Box, d: int, r: tuple[int, int]) -> Box:
    ranges = list(box.ranges)
    ranges[d] = r
    return Box._trusted(tuple(ranges))


class LayoutKind(enum.StrEnum):
    """The framework a layout describes (a member is its name: ``LayoutKind.FSDP2 == "fsdp2"``)."""

    FSDP2 = "fsdp2"
    MEGATRON = "megatron"
    #: An inference engine (SGLang, vLLM).
    INFERENCE = "inference"
    #: Built by hand or by the test strategies, not by a layout function.
    SYNTHETIC = "synthetic"

    def __repr__(self) -> str:
        return f"LayoutKind.{self.name}"

    @classmethod
    def of(cls, backend: Backend) -> "LayoutKind":
        """The kind of layout a component of ``backend`` has."""
        if backend is Backend.FSDP:
            return cls.FSDP2
        if backend is Backend.MEGATRON:
            return cls.MEGATRON
        return cls.INFERENCE


def _kind(value: object) -> LayoutKind:
    if isinstance(value, str) and value in LayoutKind._value2member_map_:
        return LayoutKind(value)
    raise LayoutError(
        f"Layout.kind={value!r} is not a layout kind; use one of "
        f"{[k.value for k in LayoutKind]} (LayoutKind)"
    )


def _check_tensors(_inst: object, _attr: object, tensors: tuple[LogicalTensor, ...]) -> None:
    names: set[str] = set()
    for t in tensors:
        if t.name in names and not t.present:
            raise LayoutError(
                f"layout has tensor {t.name!r} twice without presence constraints to tell them apart"
            )
        names.add(t.name)


@attrs.frozen(kw_only=True, slots=False)
class Layout:
    """Every rank's local tensors, as logical tensors over one world of ranks.

    ``canonical`` lists the canonical tensors the layout draws from (the model), in
    checkpoint order; ``kind`` names the framework (:class:`LayoutKind`). A Megatron
    layout carries the stage plan it was built from in ``stages`` (``None`` for other
    kinds); it is not part of equality, since the tensors' presence on ``pp`` says the same.
    """

    kind: LayoutKind = attrs.field(converter=_kind)
    world_size: int
    canonical: tuple[TensorSpec, ...] = attrs.field(converter=_specs)
    tensors: tuple[LogicalTensor, ...] = attrs.field(converter=_logical, validator=_check_tensors)
    stages: StagePlan | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        for t in self.tensors:
            if t.sharding.mesh.size != self.world_size:
                raise LayoutError(
                    f"{t.name}: its mesh {t.sharding.mesh} has {t.sharding.mesh.size} ranks, the layout "
                    f"{self.world_size}; every tensor's mesh must cover the whole world"
                )
        known = {c.name: c for c in self.canonical}
        for t in self.tensors:
            for f in t.fusion:
                spec = known.get(f.canonical)
                if spec is None:
                    raise LayoutError(
                        f"{t.name}: fusion piece names {f.canonical!r}, which is not a canonical tensor"
                    )
                if not _fits(spec.shape, f.canonical_region):
                    raise LayoutError(
                        f"{t.name}: fusion piece box {f.canonical_region} lies outside {f.canonical!r} of shape {spec.shape}"
                    )

    @functools.cached_property
    def is_strided(self) -> bool:
        """Some piece is strided or transposed (gpt-oss experts under Megatron): code that
        reads plain canonical boxes only must lift the layout first
        (:mod:`areal_fn.layouts.lift`) or refuse it."""
        return any(t.is_strided for t in self.tensors)

    @property
    def meshes(self) -> tuple[Mesh, ...]:
        out: list[Mesh] = []
        for t in self.tensors:
            if t.sharding.mesh not in out:
                out.append(t.sharding.mesh)
        return tuple(out)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank={rank} is outside this {self.kind} layout of {self.world_size} ranks"
            )

    @beartype
    def local_tensors(self, rank: int) -> tuple[LocalTensor, ...]:
        """The local tensors ``rank`` holds, in layout order."""
        self._check_rank(rank)
        found: list[int] = []
        for (mesh, present), indices in self._by_presence.items():
            if not present:
                found.extend(indices)
                continue
            coords = mesh.coords(rank)
            if all(coords[mesh.axis_index(a)] == c for a, c in present):
                found.extend(indices)
        found.sort()
        return tuple(
            _local(self.tensors[i], self.tensors[i].sharding.mesh.coords(rank)) for i in found
        )

    @functools.cached_property
    def _by_presence(self) -> dict[tuple[Mesh, tuple[tuple[str, int], ...]], list[int]]:
        index: dict[tuple[Mesh, tuple[tuple[str, int], ...]], list[int]] = {}
        for i, t in enumerate(self.tensors):
            index.setdefault((t.sharding.mesh, t.present), []).append(i)
        return index

    @functools.cached_property
    def _by_name(self) -> dict[str, LogicalTensor]:
        out: dict[str, LogicalTensor] = {}
        for t in self.tensors:
            out.setdefault(t.name, t)
        return out

    def tensor(self, name: str) -> LogicalTensor:
        """The first logical tensor called ``name``."""
        t = self._by_name.get(name)
        if t is not None:
            return t
        raise LayoutError(f"layout has no tensor {name!r}")

    def holders(self, canonical: str) -> tuple[tuple[int, str, Piece], ...]:
        """Every (rank, local tensor name, piece) holding part of ``canonical``."""
        out = []
        for r in range(self.world_size):
            for lt in self.local_tensors(r):
                for p in lt.pieces:
                    if p.canonical == canonical:
                        out.append((r, lt.name, p))
        return tuple(out)
