"""`View`: how a strided, transposed piece lays canonical elements into a local box.

A plain piece maps its canonical box onto its local (or logical) box by a row-major
reshape. A piece with a :class:`View` takes every ``step[d]``-th element of its
canonical box along dim ``d`` (the box runs from the first taken element to just past
the last: ``stop - start == step * (n - 1) + 1``), then orders the dims as ``perm``
says (``permute(perm)``), then maps by a row-major reshape, which may only drop or add
dims of extent 1. gpt-oss experts need it: Megatron's ``linear_fc1`` of expert ``e``
is ``[W[e][:, ::2].T; W[e][:, 1::2].T]`` of the checkpoint's ``gate_up_proj [E, H, 2I]``.

In torch terms, with ``t`` the canonical tensor:
``local[local_box] = t[view_slices(box, view)].permute(view.perm).reshape(local_box.shape)``.
"""

from collections.abc import Iterable

import attrs

from areal_fn.errors import LayoutError
from areal_fn.sharding.box import Box


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class View:
    """A step per canonical dim and the order of the canonical dims in the local box."""

    step: tuple[int, ...] = attrs.field(converter=_ints)
    perm: tuple[int, ...] = attrs.field(converter=_ints)

    def __attrs_post_init__(self) -> None:
        if sorted(self.perm) != list(range(len(self.step))) or any(s < 1 for s in self.step):
            raise LayoutError(
                f"View(step={self.step}, perm={self.perm}): step needs one int >= 1 per "
                "canonical dim and perm a permutation of those dims"
            )

    def __str__(self) -> str:
        return f"step{self.step}perm{self.perm}"


def counts(box: Box, view: View) -> tuple[int, ...]:
    """The elements ``box`` takes per canonical dim under ``view`` (canonical dim order)."""
    return tuple(-(-(hi - lo) // s) for (lo, hi), s in zip(box.ranges, view.step, strict=True))


def view_shape(box: Box, view: View) -> tuple[int, ...]:
    """The shape of the taken elements once permuted (before extent-1 dims are dropped)."""
    n = counts(box, view)
    return tuple(n[d] for d in view.perm)


def view_slices(box: Box, view: View) -> tuple[slice, ...]:
    """Index the canonical tensor with ``t[view_slices(box, view)]``."""
    return tuple(slice(lo, hi, s) for (lo, hi), s in zip(box.ranges, view.step, strict=True))


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def check_view(name: str, box: Box, view: View, target: Box) -> None:
    """``LayoutError`` unless ``box`` under ``view`` fills ``target`` element for element."""
    if len(view.step) != box.ndim:
        raise LayoutError(
            f"piece of {name!r}: view {view} has {len(view.step)} dims, its canonical box "
            f"{box} has {box.ndim}"
        )
    loose = [
        d
        for d, ((lo, hi), s) in enumerate(zip(box.ranges, view.step, strict=True))
        if hi > lo and (hi - lo - 1) % s
    ]
    if loose:
        raise LayoutError(
            f"piece of {name!r}: canonical box {box} does not end at its last element under "
            f"step {view.step} (dims {loose}); give stop = start + step * (n - 1) + 1"
        )
    shape = view_shape(box, view)
    if _squeezed(shape) != _squeezed(target.shape):
        raise LayoutError(
            f"piece of {name!r}: canonical box {box} under view {view} has shape {shape}, its "
            f"target box {target} {target.shape}; they must match element for element (only "
            "dims of extent 1 may differ)"
        )


def sub_box(box: Box, view: View, target: Box, part: Box) -> Box:
    """The canonical box (under the same ``view``) whose elements land in ``part``, a
    sub-box of ``target`` (the box ``box`` fills)."""
    shape = view_shape(box, view)
    tdims = [d for d in range(target.ndim) if target.shape[d] > 1]
    vdims = [d for d in range(len(shape)) if shape[d] > 1]
    ranges = list(box.ranges)
    for t, v in zip(tdims, vdims, strict=True):
        c, step = view.perm[v], view.step[view.perm[v]]
        lo = box.ranges[c][0] + step * (part.ranges[t][0] - target.ranges[t][0])
        ranges[c] = (lo, lo + step * (part.shape[t] - 1) + 1)
    return Box._trusted(tuple(ranges))
