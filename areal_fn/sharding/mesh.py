"""`Mesh`: ordered named axes with sizes, ranks laid out row-major.

Rank order is row-major over the axes in order (the last axis varies fastest), which
is what ``torch.distributed.init_device_mesh`` builds; Megatron's rank order
``tp-cp-ep-dp-pp`` (tp fastest) is the same mesh with axes listed ``(pp, dp, ..., tp)``.
"""

import enum
import math
from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError


class Axis(enum.StrEnum):
    """The mesh axes the layouts build (a member is its name: ``Axis.TP == "tp"``).

    Megatron's dense mesh is ``(PP, DP, CP, TP)`` and its expert mesh
    ``(PP, EDP, EP, ETP)``; FSDP2's is ``([DP_REPLICATE,] DP_SHARD[, TP])``; an
    inference engine's ``(DP, PP, TP)``, with ``TP`` split into ``(TP_KV, TP_REP)`` where
    KV heads are replicated. A :class:`Mesh` also takes other identifiers (a user's own
    mesh); it stores names as plain strings.
    """

    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"
    EDP = "edp"
    EP = "ep"
    ETP = "etp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP_KV = "tp_kv"
    TP_REP = "tp_rep"

    def __repr__(self) -> str:
        return f"Axis.{self.name}"


def _names(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise SpecError(f"Mesh.names={value!r} must be a sequence of axis names, e.g. ('dp', 'tp')")
    return tuple(n.value if isinstance(n, Axis) else n for n in value)


def _sizes(value: object) -> tuple[int, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise SpecError(f"Mesh.sizes={value!r} must be a sequence of ints, e.g. (2, 4)")
    return tuple(value)


def _check_names(_inst: object, _attr: object, names: tuple[str, ...]) -> None:
    for n in names:
        if not isinstance(n, str) or not n.isidentifier() or not n.isascii():
            raise SpecError(
                f"Mesh axis name {n!r} is not an ASCII identifier; use names like 'dp', 'tp', 'dp_shard'"
            )
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise SpecError(
                f"Mesh.names={names!r} repeats axis {n!r}; every axis name must be unique"
            )
        seen.add(n)


def _check_sizes(_inst: object, _attr: object, sizes: tuple[int, ...]) -> None:
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise SpecError(
                f"Mesh.sizes={sizes!r} has size {s!r}; every axis size must be an int >= 1"
            )


def _check_mesh(inst: "Mesh") -> None:
    if len(inst.names) != len(inst.sizes):
        raise SpecError(
            f"Mesh has {len(inst.names)} names {inst.names!r} but {len(inst.sizes)} sizes "
            f"{inst.sizes!r}; give one size per axis"
        )


@attrs.frozen(kw_only=True)
class Mesh:
    """A device mesh: ``Mesh.of(dp=2, tp=4)`` is 8 ranks, ``tp`` varying fastest."""

    names: tuple[str, ...] = attrs.field(converter=_names, validator=_check_names)
    sizes: tuple[int, ...] = attrs.field(converter=_sizes, validator=_check_sizes)

    def __attrs_post_init__(self) -> None:
        _check_mesh(self)

    @classmethod
    def of(cls, **axes: int) -> "Mesh":
        """Build from keywords; keyword order is axis order: ``Mesh.of(dp=2, tp=4)``."""
        return cls(names=tuple(axes), sizes=tuple(axes.values()))

    # -- basic queries ---------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.names)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return math.prod(self.sizes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def axis_index(self, axis: str) -> int:
        if axis not in self.names:
            raise SpecError(f"mesh axis {axis!r} does not exist; this mesh has axes {self.names!r}")
        return self.names.index(axis)

    def axis_size(self, axis: str) -> int:
        return self.sizes[self.axis_index(axis)]

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise SpecError(
                f"rank={rank!r} is outside this mesh of {self.size} ranks; use 0..{self.size - 1}"
            )

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` along every axis (row-major, last axis fastest)."""
        self._check_rank(rank)
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank(self, coords: Sequence[int]) -> int:
        """Inverse of :meth:`coords`."""
        if len(coords) != self.ndim:
            raise SpecError(
                f"coords={tuple(coords)!r} has {len(coords)} entries; this mesh has {self.ndim} axes {self.names!r}"
            )
        r = 0
        for c, s, n in zip(coords, self.sizes, self.names, strict=True):
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < s:
                raise SpecError(f"coordinate {c!r} on axis {n!r} is outside 0..{s - 1}")
            r = r * s + c
        return r

    def groups(self, axes: "str | Sequence[str]") -> tuple[tuple[int, ...], ...]:
        """Rank groups along one axis (or several, flattened in the given order).

        Groups are listed in row-major order of the remaining axes, ranks inside a group
        in row-major order of ``axes``: exactly ``DeviceMesh``'s groups for one axis.
        """
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if not names:
            raise SpecError("groups() needs at least one axis name")
        idx = [self.axis_index(a) for a in names]
        if len(set(idx)) != len(idx):
            raise SpecError(f"groups({names!r}) repeats an axis")
        rest = [i for i in range(self.ndim) if i not in idx]
        out = []
        for rest_rank in range(math.prod(self.sizes[i] for i in rest)):
            rest_coords = _unravel(rest_rank, [self.sizes[i] for i in rest])
            group = []
            for inner in range(math.prod(self.sizes[i] for i in idx)):
                inner_coords = _unravel(inner, [self.sizes[i] for i in idx])
                c = [0] * self.ndim
                for i, v in zip(rest, rest_coords, strict=True):
                    c[i] = v
                for i, v in zip(idx, inner_coords, strict=True):
                    c[i] = v
                group.append(self.rank(c))
            out.append(tuple(group))
        return tuple(out)

    def group_of(self, rank: int, axes: "str | Sequence[str]") -> tuple[int, ...]:
        """The group along ``axes`` that contains ``rank``."""
        self._check_rank(rank)
        for g in self.groups(axes):
            if rank in g:
                return g
        raise AssertionError("unreachable: every rank is in one group")

    # -- reshaping -----------------------------------------------------------------
    def split(self, axis: str, **factors: int) -> "Mesh":
        """Factor one axis into several (major to minor), ranks unchanged.

        ``Mesh.of(tp=8).split("tp", tp_kv=4, tp_rep=2)``.
        """
        i = self.axis_index(axis)
        size = self.sizes[i]
        if not factors:
            raise SpecError(
                f"split({axis!r}) needs at least one factor, e.g. split('{axis}', a=2, b={size // 2 or 1})"
            )
        prod = math.prod(factors.values())
        if prod != size:
            raise SpecError(
                f"split of axis {axis!r} (size {size}) into {factors!r}: the factors multiply to "
                f"{prod}, not {size}; choose factors whose product is {size}"
            )
        names = self.names[:i] + tuple(factors) + self.names[i + 1 :]
        sizes = self.sizes[:i] + tuple(factors.values()) + self.sizes[i + 1 :]
        return Mesh(names=names, sizes=sizes)

    def flatten(self, axes: Sequence[str], name: str) -> "Mesh":
        """Merge adjacent axes (in mesh order) into one named ``name``, ranks unchanged."""
        axes = tuple(axes)
        idx = [self.axis_index(a) for a in axes]
        if not idx or idx != list(range(idx[0], idx[0] + len(idx))):
            raise SpecError(
                f"flatten({axes!r}): axes must be adjacent and in mesh order {self.names!r}; "
                "for other combinations use groups(axes), which flattens any subset"
            )
        lo, hi = idx[0], idx[-1] + 1
        names = self.names[:lo] + (name,) + self.names[hi:]
        sizes = self.sizes[:lo] + (math.prod(self.sizes[lo:hi]),) + self.sizes[hi:]
        return Mesh(names=names, sizes=sizes)

    def __str__(self) -> str:
        return (
            "Mesh("
            + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
            + ")"
        )


def _unravel(index: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        out.append(index % s)
        index //= s
    return tuple(reversed(out))
