"""Lifting: layouts with strided pieces restated as plain ones, by views of the tensors.

A gpt-oss expert under Megatron-Core holds ``gate_up_proj [E, H, 2I]`` de-interleaved
and transposed: ``linear_fc1 = [W[e][:, ::2].T; W[e][:, 1::2].T]``, two strided pieces
(:mod:`areal_fn.sharding.strided`). In the *lifted basis* of that canonical tensor,
``[E, H, I, 2]`` (column ``2u + g`` is unit ``u``, phase ``g``: a row-major reshape, the
same elements in the same order), the two pieces together are the plain box
``[e, :, :, :]``, and ``linear_fc1`` seen through ``fc1.unflatten(0, (2, I))``, moved and
permuted into ``[1, H, I, 2]`` (views: no copy), holds that box element for element.

:func:`lift_layouts` restates layouts that way. Every canonical tensor that some strided
piece takes with a step gets its lifted shape, in every layout given, so that they still
describe one model. Every logical tensor made of strided pieces becomes the view of it
that holds one plain box, or, when its pieces take one phase each (Megatron's per-expert
``lora_B``: columns ``e::E`` of PEFT's ``[out, E * r]``, lifted ``[out, r, E]``), is seen
with a dim of 1 after the strided one, each piece the plain box of its units and its
phase (its sharding kept). Every logical tensor that holds a lifted canonical tensor
plainly (FSDP2's and the inference engines' ``gate_up_proj``) has the dim split the same
way (``unflatten``: a view), its sharding kept. The lifted layouts are plain, so the
transfer and checkpoint planners place them unchanged; a :class:`LocalView` per tensor
name says how to view the real local tensor, and :func:`apply_view` applies it.

A layout that cannot be lifted so is refused with a :class:`~areal_fn.errors.LayoutError`
naming the tensor and the rule: strided pieces of a tensor must together fill a plain
box of one canonical tensor (all phases of a step, stacked along one logical dim) or
take one phase each, a tensor holding a stack must not be sharded, and a plain piece or
shard of a lifted canonical tensor must hold whole units of the step.
"""

import functools
from collections.abc import Iterable, Mapping

import attrs
import torch

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece, Layout, LogicalTensor
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.sharding.box import Box
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard
from areal_fn.sharding.sharding import Sharding, local_pieces
from areal_fn.sharding.strided import counts, view_shape
from areal_fn.typecheck import beartype

__all__ = [
    "LiftedLayout",
    "LocalView",
    "apply_view",
    "lift_box",
    "lift_layouts",
    "lifted_shape",
    "unlift_box",
    "viewed",
]

#: canonical name -> the step of each of its dims (1: not lifted)
Factors = Mapping[str, tuple[int, ...]]


def _ops(value: Iterable[tuple[str, Iterable[int]]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((str(op), tuple(int(a) for a in args)) for op, args in value)


_KNOWN_OPS = ("unflatten", "movedim", "reshape", "permute")


@attrs.frozen(kw_only=True)
class LocalView:
    """How to see a local tensor in the lifted basis: torch view operations, in order.

    ``("unflatten", (dim, a, b))``, ``("movedim", (src, dst))``, ``("reshape", shape)``,
    ``("permute", perm)``; each returns a view of the tensor (no copy), so writing into
    the result writes the tensor.
    """

    ops: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(converter=_ops)

    def __attrs_post_init__(self) -> None:
        bad = [op for op, _ in self.ops if op not in _KNOWN_OPS]
        if bad:
            raise LayoutError(f"LocalView ops {bad} are not among {list(_KNOWN_OPS)}")

    def __str__(self) -> str:
        return ".".join(f"{op}{args}" for op, args in self.ops) or "identity"


@beartype
def apply_view(view: LocalView, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """``tensor`` seen through ``view`` (a view of it: writes go to ``tensor``)."""
    t = tensor
    try:
        for op, args in view.ops:
            if op == "unflatten":
                t = t.unflatten(args[0], args[1:])
            elif op == "movedim":
                t = t.movedim(args[0], args[1])
            elif op == "permute":
                t = t.permute(args)
            else:
                t = t.view(args)
    except RuntimeError as e:
        raise LayoutError(
            f"{name} of shape {tuple(tensor.shape)} cannot be viewed as {view} ({e}); pass the "
            "tensor the layout describes"
        ) from None
    return t


def viewed(
    views: Mapping[str, LocalView],
    name: str,
    tensor: torch.Tensor,
    what: str,
    error: type[Exception] = LayoutError,
) -> torch.Tensor:
    """Local tensor ``name`` through its view in ``views``, if it has one; a tensor the
    view does not fit raises ``error`` (``what`` names it: "source tensor", ...)."""
    view = views.get(name)
    if view is None:
        return tensor
    try:
        return apply_view(view, tensor, f"{what} {name!r}")
    except LayoutError as e:
        raise error(str(e)) from None


@attrs.frozen(kw_only=True)
class LiftedLayout:
    """``layout`` in the lifted basis; ``views``: (tensor name, view) of every tensor whose
    local form is a view of the real one; ``factors``: (canonical name, step per dim)."""

    layout: Layout
    views: tuple[tuple[str, LocalView], ...] = ()
    factors: tuple[tuple[str, tuple[int, ...]], ...] = ()


def lifted_shape(shape: tuple[int, ...], steps: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with every dim of step ``s > 1`` split into ``(n // s, s)``."""
    out: list[int] = []
    for n, s in zip(shape, steps, strict=True):
        out.extend((n // s, s) if s > 1 else (n,))
    return tuple(out)


def _lifted_ranges(
    ranges: tuple[tuple[int, int], ...], steps: tuple[int, ...]
) -> tuple[tuple[int, int], ...] | None:
    """A plain box's ranges in the lifted basis, or None when one cuts inside a unit."""
    out: list[tuple[int, int]] = []
    for (lo, hi), s in zip(ranges, steps, strict=True):
        if s == 1:
            out.append((lo, hi))
        elif lo % s or hi % s:
            return None
        else:
            out.extend(((lo // s, hi // s), (0, s)))
    return tuple(out)


def lift_box(box: Box, steps: tuple[int, ...]) -> Box | None:
    """A plain canonical ``box`` in the lifted basis of ``steps`` (each range of a dim of
    step ``s`` becomes units and all ``s`` phases), or None when it cuts inside a unit."""
    ranges = _lifted_ranges(box.ranges, steps)
    return None if ranges is None else Box._trusted(ranges)


def unlift_box(box: Box, steps: tuple[int, ...]) -> Box | None:
    """The plain canonical box of a lifted ``box`` (the inverse of :func:`lift_box`), or
    None when it holds only some phases of its units (a strided region)."""
    out: list[tuple[int, int]] = []
    i = 0
    for s in steps:
        if s == 1:
            out.append(box.ranges[i])
            i += 1
            continue
        (u0, u1), phases = box.ranges[i], box.ranges[i + 1]
        if phases != (0, s):
            return None
        out.append((u0 * s, u1 * s))
        i += 2
    return Box._trusted(tuple(out))


def _factors(layouts: Iterable[Layout]) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for t in layout.tensors:
            for f in t.fusion:
                if f.view is None or all(s == 1 for s in f.view.step):
                    continue
                known = found.setdefault(f.canonical, f.view.step)
                if known != f.view.step:
                    raise LayoutError(
                        f"{t.name}: its piece of {f.canonical!r} takes steps {f.view.step}, "
                        f"another piece steps {known}; lifting needs one step per dim of a "
                        "canonical tensor"
                    )
    return found


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(perm.index(i) for i in range(len(perm)))


def _refuse(t: LogicalTensor, rule: str) -> LayoutError:
    return LayoutError(
        f"{t.name}: its strided pieces cannot be lifted to a plain box: {rule}; transfer and "
        "checkpoint plans place strided pieces that together fill a plain box of one "
        "canonical tensor (gpt-oss experts under Megatron-Core)"
    )


#: (lifted box ranges, view) of a strided tensor, by its geometry
_Memo = dict[tuple[object, ...], tuple[tuple[tuple[int, int], ...], LocalView]]


def _lift_strided(
    t: LogicalTensor, factors: Factors, memo: _Memo
) -> tuple[LogicalTensor, LocalView]:
    """The view of ``t`` (all pieces strided) that holds one plain lifted box; tensors of
    equal geometry (a layer's experts) are worked out once (``memo``)."""
    if any(f.view is None for f in t.fusion) or len({f.canonical for f in t.fusion}) != 1:
        raise _refuse(t, "it mixes strided and plain pieces or several canonical tensors")
    phased = _lift_phases(t, factors)
    if phased is not None:
        return phased
    name = t.fusion[0].canonical
    key = (
        t.shape,
        t.sharding.placements,
        factors.get(name),
        tuple(
            (f.canonical_region.ranges, f.view.step, f.view.perm, f.logical_box.ranges)
            for f in t.fusion
            if f.view is not None
        ),
    )
    got = memo.get(key)
    if got is None:
        got = memo[key] = _strided_geometry(t, factors)
    ranges, view = got
    return _with_piece(t, name, ranges), view


def _lift_phases(t: LogicalTensor, factors: Factors) -> tuple[LogicalTensor, LocalView] | None:
    """``t`` seen with a dim of 1 after strided dim ``c``, when its pieces take one phase
    each (in canonical dim order; not all phases of one stack); None otherwise."""
    view, name = t.fusion[0].view, t.fusion[0].canonical
    strided = [] if view is None else [d for d, s in enumerate(view.step) if s > 1]
    if (
        view is None
        or any(f.view != view or f.stacked_dims or f.canonical != name for f in t.fusion)
        or view.perm != tuple(range(len(view.step)))
        or len(strided) != 1
        or len(t.shape) != len(view.step)
        or factors.get(name) != view.step
    ):
        return None
    c, s = strided[0], view.step[strided[0]]
    if sorted(f.canonical_region.ranges[c][0] % s for f in t.fusion) == list(range(s)):
        return None  # the phases of one stack: one plain box (_strided_geometry)
    pieces = []
    for f in t.fusion:
        cr, lr, n = (
            f.canonical_region.ranges,
            f.logical_box.ranges,
            counts(f.canonical_region, view),
        )
        u, g = divmod(cr[c][0], s)
        cbox = Box(ranges=(*cr[:c], (u, u + n[c]), (g, g + 1), *cr[c + 1 :]))
        lbox = Box(ranges=(*lr[: c + 1], (0, 1), *lr[c + 1 :]))
        pieces.append(
            FusionPiece(canonical=name, canonical_box=cbox, logical_box=lbox, tied=f.tied)
        )
    moved = tuple(_moved(p, {c: s}) for p in t.sharding.placements)
    shape = (*t.shape[: c + 1], 1, *t.shape[c + 1 :])
    sharding = Sharding(mesh=t.sharding.mesh, placements=moved)
    lifted = attrs.evolve(t, shape=shape, fusion=tuple(pieces), sharding=sharding)
    return lifted, LocalView(ops=(("unflatten", (c, t.shape[c], 1)),))


def _strided_geometry(
    t: LogicalTensor, factors: Factors
) -> tuple[tuple[tuple[int, int], ...], LocalView]:
    if len({f.view for f in t.fusion}) != 1:
        raise _refuse(t, "its pieces take different steps or orders")
    if not all(isinstance(p, Replicate) for p in t.sharding.placements):
        raise _refuse(t, f"it is sharded {t.sharding.placements_str}, not replicated")
    first = t.fusion[0]
    view, name = first.view, first.canonical
    assert view is not None  # checked above
    steps = factors.get(name, (1,) * len(view.step))
    strided = [d for d, s in enumerate(view.step) if s > 1]
    if [d for d, s in enumerate(steps) if s > 1] != strided:
        raise _refuse(t, f"it takes {name!r} with steps {view.step}, the layouts lift {steps}")
    perm_back = _inverse(view.perm)
    if not strided:
        if len(t.fusion) != 1 or first.logical_box != Box.full(t.shape):
            raise _refuse(t, "a transposed piece must fill its tensor alone")
        region = first.canonical_region
        ops: tuple[tuple[str, tuple[int, ...]], ...] = (
            ("reshape", view_shape(region, view)),
            ("permute", perm_back),
        )
        return region.ranges, LocalView(ops=ops)
    if len(strided) > 1:
        raise _refuse(t, f"it takes steps on more than one dim ({view.step})")
    c = strided[0]
    s = view.step[c]
    by_phase = {f.canonical_region.ranges[c][0] % s: f for f in t.fusion}
    if sorted(by_phase) != list(range(s)) or len(t.fusion) != s:
        raise _refuse(t, f"its {len(t.fusion)} pieces are not the {s} phases of step {s}")
    regions = [by_phase[g].canonical_region for g in range(s)]
    n = counts(regions[0], view)
    if any(counts(r, view) != n for r in regions) or any(
        r.ranges[:c] + r.ranges[c + 1 :] != regions[0].ranges[:c] + regions[0].ranges[c + 1 :]
        or r.ranges[c][0] // s != regions[0].ranges[c][0] // s
        for r in regions
    ):
        raise _refuse(t, "its phases cover different units")
    boxes = [by_phase[g].logical_box for g in range(s)]
    differ = [d for d in range(len(t.shape)) if len({b.ranges[d] for b in boxes}) > 1]
    m = t.shape[differ[0]] // s if len(differ) == 1 else 0
    dim = differ[0] if differ else -1
    if (
        len(differ) != 1
        or t.shape[dim] != s * m
        or any(b.ranges[dim] != (g * m, (g + 1) * m) for g, b in enumerate(boxes))
        or any(
            b.ranges[d] != (0, t.shape[d]) for b in boxes for d in range(len(t.shape)) if d != dim
        )
    ):
        raise _refuse(t, f"its phases are not stacked in order along one dim of {t.shape}")
    ops = (
        ("unflatten", (dim, s, m)),
        ("movedim", (dim, 0)),
        ("reshape", (s, *view_shape(regions[0], view))),
        ("permute", (0, *(1 + p for p in perm_back))),
        ("movedim", (0, c + 1)),
    )
    u0 = regions[0].ranges[c][0] // s
    ranges = regions[0].ranges
    return (*ranges[:c], (u0, u0 + n[c]), (0, s), *ranges[c + 1 :]), LocalView(ops=ops)


_NEW = object.__new__
_SET = object.__setattr__


def _with_piece(t: LogicalTensor, name: str, ranges: tuple[tuple[int, int], ...]) -> LogicalTensor:
    """``t`` as one plain piece of lifted box ``ranges`` filling it. Built without
    re-validation: the box fills the tensor, the sharding (replicated) fits any shape and
    the presence is ``t``'s own."""
    box = Box._trusted(ranges)
    shape = tuple(hi - lo for lo, hi in ranges)
    piece = FusionPiece(canonical=name, canonical_box=box, logical_box=Box.full(shape))
    out = _NEW(LogicalTensor)
    for field, value in (
        ("name", t.name),
        ("shape", shape),
        ("dtype", t.dtype),
        ("fusion", (piece,)),
        ("sharding", t.sharding),
        ("present", t.present),
    ):
        _SET(out, field, value)
    return out


def _moved(p: Placement, splits: dict[int, int]) -> Placement:
    if isinstance(p, Shard | StridedShard):
        dim = p.dim + sum(1 for d in splits if d < p.dim)
        return Shard(dim) if isinstance(p, Shard) else StridedShard(dim, p.split_factor)
    return p


def _lift_plain(t: LogicalTensor, factors: Factors) -> tuple[LogicalTensor, LocalView | None]:
    """``t`` with the dims that hold a lifted canonical dim split (a view), or ``t``."""
    splits: dict[int, int] = {}
    for f in t.fusion:
        if f.canonical not in factors:
            continue
        k = f.logical_box.ndim - f.canonical_region.ndim
        for d, s in enumerate(factors[f.canonical]):
            if s > 1 and splits.setdefault(d + k, s) != s:
                raise LayoutError(
                    f"{t.name}: its dim {d + k} holds lifted canonical dims of steps "
                    f"{splits[d + k]} and {s}; a tensor can be lifted by one step per dim"
                )
    if not splits:
        return t, None
    others = sorted({f.canonical for f in t.fusion if f.canonical not in factors})
    if others:
        raise LayoutError(
            f"{t.name}: it fuses lifted canonical tensors with {others}; lifting splits whole "
            "dims, so a tensor holding a strided-step canonical tensor must hold no other"
        )
    logical_steps = tuple(splits.get(d, 1) for d in range(len(t.shape)))
    pieces = []
    for f in t.fusion:
        cbox = _lifted_ranges(f.canonical_region.ranges, factors[f.canonical])
        lbox = _lifted_ranges(f.logical_box.ranges, logical_steps)
        if cbox is None or lbox is None:
            raise LayoutError(
                f"{t.name}: its piece {f.canonical_region} of {f.canonical!r} cuts inside units "
                f"of steps {factors[f.canonical]}; lifting needs whole units"
            )
        pieces.append(
            FusionPiece(
                canonical=f.canonical,
                canonical_box=Box(ranges=cbox),
                logical_box=Box(ranges=lbox),
                tied=f.tied,
            )
        )
    shape = lifted_shape(t.shape, logical_steps)
    if any(n % s for n, s in zip(t.shape, logical_steps, strict=True)):
        raise LayoutError(f"{t.name}: shape {t.shape} holds no whole units of {logical_steps}")
    sharding = Sharding(
        mesh=t.sharding.mesh, placements=tuple(_moved(p, splits) for p in t.sharding.placements)
    )
    bad = _first_cut_rank(t.shape, t.sharding, logical_steps, shape, sharding)
    if bad is not None:
        raise LayoutError(
            f"{t.name}: its sharding {t.sharding.placements_str} cuts inside units of "
            f"{logical_steps} on rank {bad}; lifting needs shards of whole units (pick "
            "sizes that divide the units evenly)"
        )
    lifted = LogicalTensor(
        name=t.name,
        shape=shape,
        dtype=t.dtype,
        fusion=tuple(pieces),
        sharding=sharding,
        present=t.present,
    )
    position = 0
    ops = []
    for d in range(len(t.shape)):
        if d in splits:
            ops.append(("unflatten", (position, -1, splits[d])))
            position += 1
        position += 1
    return lifted, LocalView(ops=tuple(ops))


@functools.lru_cache(maxsize=4096)
def _first_cut_rank(
    shape: tuple[int, ...],
    sharding: Sharding,
    steps: tuple[int, ...],
    lifted: tuple[int, ...],
    lifted_sharding: Sharding,
) -> int | None:
    """The first rank whose shards of ``shape`` under ``sharding`` are not, lifted by
    ``steps``, its shards of ``lifted`` under ``lifted_sharding`` (None: every rank's are)."""
    for rank in range(sharding.mesh.size):
        want = [
            (_lifted_ranges(g.ranges, steps), _lifted_ranges(loc.ranges, steps))
            for g, loc in local_pieces(shape, sharding, rank)
        ]
        got = [(g.ranges, loc.ranges) for g, loc in local_pieces(lifted, lifted_sharding, rank)]
        if want != got:
            return rank
    return None


def _lift(layout: Layout, factors: Factors) -> LiftedLayout:
    tensors: list[LogicalTensor] = []
    views: dict[str, LocalView] = {}
    memo: _Memo = {}
    for t in layout.tensors:
        if t.is_strided:
            lifted, view = _lift_strided(t, factors, memo)
        else:
            lifted, maybe = _lift_plain(t, factors)
            if maybe is None:
                tensors.append(t)
                continue
            view = maybe
        if views.setdefault(t.name, view) != view:
            raise LayoutError(
                f"{t.name}: tensors of this name are viewed as {views[t.name]} and as {view}; "
                "lifting needs one view per tensor name"
            )
        tensors.append(lifted)
    for c in layout.canonical:
        if c.name in factors and any(n % s for n, s in zip(c.shape, factors[c.name], strict=True)):
            raise LayoutError(
                f"canonical {c.name!r} of shape {c.shape} holds no whole units of steps "
                f"{factors[c.name]}"
            )
    canonical = tuple(
        TensorSpec(name=c.name, shape=lifted_shape(c.shape, factors[c.name]), dtype=c.dtype)
        if c.name in factors
        else c
        for c in layout.canonical
    )
    out = attrs.evolve(layout, canonical=canonical, tensors=tuple(tensors))
    return LiftedLayout(
        layout=out,
        views=tuple(sorted(views.items())),
        factors=tuple(
            sorted((n, s) for n, s in factors.items() if n in {c.name for c in canonical})
        ),
    )


@beartype
def lift_layouts(*layouts: Layout) -> tuple[LiftedLayout, ...]:
    """Each layout in the lifted basis of all of them (see the module docstring); a layout
    untouched by lifting comes back as it is, with no views."""
    if not any(layout.is_strided for layout in layouts):
        return tuple(LiftedLayout(layout=layout) for layout in layouts)
    factors = _factors(layouts)
    return tuple(
        _lift(layout, factors) if factors or layout.is_strided else LiftedLayout(layout=layout)
        for layout in layouts
    )
