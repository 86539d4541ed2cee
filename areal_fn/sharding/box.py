"""`Box`: a product of half-open index ranges, the unit of all piece geometry."""

import functools
from collections.abc import Sequence

import attrs

from areal_fn.errors import SpecError


def _ranges(value: object) -> tuple[tuple[int, int], ...]:
    if type(value) is tuple and all(
        type(r) is tuple
        and len(r) == 2
        and type(r[0]) is int
        and type(r[1]) is int
        and 0 <= r[0] <= r[1]
        for r in value
    ):
        return value  # fast path: already a tuple of valid (start, stop) int pairs
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise SpecError(f"Box.ranges={value!r} must be a sequence of (start, stop) pairs")
    out = []
    for i, r in enumerate(value):
        if not isinstance(r, Sequence) or len(r) != 2:
            raise SpecError(f"Box.ranges[{i}]={r!r} must be a (start, stop) pair")
        lo, hi = r
        for v in (lo, hi):
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"Box.ranges[{i}]={r!r}: bounds must be ints")
        if not 0 <= lo <= hi:
            raise SpecError(f"Box.ranges[{i}]={r!r} violates 0 <= start <= stop")
        out.append((lo, hi))
    return tuple(out)


@attrs.frozen(kw_only=True)
class Box:
    """Half-open ranges, one per tensor dim: ``Box(ranges=((0, 4), (2, 6)))``."""

    ranges: tuple[tuple[int, int], ...] = attrs.field(converter=_ranges)

    @classmethod
    def _trusted(cls, ranges: tuple[tuple[int, int], ...]) -> "Box":
        """A box from ranges already known valid (internal hot paths; no checks)."""
        box = object.__new__(cls)
        object.__setattr__(box, "ranges", ranges)
        return box

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of ``shape``."""
        return (
            _full_box(tuple(int(d) for d in shape))
            if cls is Box
            else cls(ranges=tuple((0, int(d)) for d in shape))
        )

    @property
    def ndim(self) -> int:
        return len(self.ranges)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.ranges)

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(lo for lo, _ in self.ranges)

    @property
    def numel(self) -> int:
        n = 1
        for lo, hi in self.ranges:
            n *= hi - lo
        return n

    @property
    def is_empty(self) -> bool:
        return any(hi == lo for lo, hi in self.ranges)

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor with ``t[box.slices()]``."""
        return tuple(slice(lo, hi) for lo, hi in self.ranges)

    def _check_ndim(self, other: "Box") -> None:
        if other.ndim != self.ndim:
            raise SpecError(
                f"boxes of different rank: {self} has {self.ndim} dims, {other} has {other.ndim}"
            )

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when the two do not overlap (or one is empty)."""
        self._check_ndim(other)
        out = []
        for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges, strict=True):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo >= hi:
                return None
            out.append((lo, hi))
        return Box._trusted(tuple(out))

    def contains(self, other: "Box") -> bool:
        self._check_ndim(other)
        return all(
            a0 <= b0 and b1 <= a1
            for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges, strict=True)
        )

    def shift(self, offset: Sequence[int]) -> "Box":
        """Translate by ``offset`` (may be negative, the result must stay >= 0)."""
        if len(offset) != self.ndim:
            raise SpecError(f"offset {tuple(offset)} has {len(offset)} dims, box has {self.ndim}")
        out = tuple((lo + o, hi + o) for (lo, hi), o in zip(self.ranges, offset, strict=True))
        if any(lo < 0 for lo, _ in out):
            raise SpecError(
                f"{self} shifted by {tuple(offset)} leaves the index space (negative start)"
            )
        return Box._trusted(out)

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        if not outer.contains(self):
            raise SpecError(f"{self} is not inside {outer}")
        return self.shift(tuple(-s for s in outer.start))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.ranges) + "]"


@functools.lru_cache(maxsize=8192)
def _full_box(shape: tuple[int, ...]) -> Box:
    return Box(ranges=tuple((0, d) for d in shape))
