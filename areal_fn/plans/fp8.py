"""Block FP8 arithmetic and the plan that lets ranks quantise their shards alone.

A weight of an FP8 checkpoint (:class:`~areal_fn.model.quantized.Fp8Format`) is stored
as ``float8_e4m3fn`` values ``q`` and one float32 ``scale`` per block of
``block = (rows, columns)`` (edge blocks are cut: the scale grid is the ceiling of the
shape over the block). The weight is ``q.float() * scale`` over each block, cast to
the model's dtype: :func:`dequantize_fp8`. Quantising takes each block's largest
magnitude ``amax``: ``scale = amax / 448`` (1 for a block of zeros) and
``q = (x.float() / scale)`` clamped to +-448, rounded to e4m3: :func:`quantize_fp8`.

Every function takes a box of the tensor (``origin``: its first row and column), so a
slice is computed exactly as the slice of the whole: both are elementwise once a block's
``amax`` is known. A block a shard box cuts needs the amax of the whole block, the
maximum of the partial amaxes of the ranks holding its parts: :func:`plan_fp8_shards`
says, for every rank, which blocks its box touches, which of them are cut and by whom
(their amax is the maximum over those ranks, an all-reduce ``MAX`` among them), and
which rank writes each scale.
"""

from collections.abc import Mapping, Sequence

import attrs
import torch
from torch import Tensor

from areal_fn.errors import ConversionError, PlanError
from areal_fn.model.quantized import Fp8Format, is_fp8_quantized
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

__all__ = [
    "FP8_MAX",
    "Fp8ShardPlan",
    "block_amax",
    "dequantize_fp8",
    "fp8_checkpoint_bytes",
    "plan_fp8_shards",
    "quantize_fp8",
    "scale_grid",
]

#: The largest finite ``float8_e4m3fn``.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@beartype
def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a weight of ``shape``: one per block, edge blocks cut."""
    return (_cdiv(shape[0], block[0]), _cdiv(shape[1], block[1]))


def _blocks_of(box: Box, block: tuple[int, int]) -> Box:
    """The box of block indices that ``box`` (rows, columns) touches."""
    return Box._trusted(
        tuple((lo // b, _cdiv(hi, b)) for (lo, hi), b in zip(box.ranges, block, strict=True))
    )


def _row_scales(scale: Tensor, bm: int, r0: int, rows: int) -> Tensor:
    """``scale`` (block rows from ``r0 // bm``) repeated per row of ``rows`` rows from ``r0``."""
    skip = r0 - (r0 // bm) * bm
    return scale.repeat_interleave(bm, dim=0)[skip : skip + rows]


def _scale_columns(x: Tensor, rows: Tensor, bn: int, c0: int, *, divide: bool) -> None:
    """Multiply (or divide) ``x`` in place by its block's scale along the columns;
    ``rows``: the per-row scales of the blocks from column block ``c0 // bn``."""
    width = x.shape[1]
    head = min(width, (-c0) % bn)  # columns before the first block boundary
    op = torch.Tensor.div_ if divide else torch.Tensor.mul_
    if head:
        op(x[:, :head], rows[:, :1])
    first = 1 if head else 0
    full = (width - head) // bn
    if full:
        body = x[:, head : head + full * bn].unflatten(1, (full, bn))
        op(body, rows[:, first : first + full, None])
    tail = width - head - full * bn
    if tail:
        op(x[:, width - tail :], rows[:, first + full : first + full + 1])


@beartype
def dequantize_fp8(
    q: Tensor,
    scale: Tensor,
    *,
    block: tuple[int, int],
    dtype: torch.dtype,
    origin: tuple[int, int] = (0, 0),
) -> Tensor:
    """The weight of FP8 values ``q``, a box of the tensor starting at ``origin``:
    ``q.float() * scale`` of each element's block, cast to ``dtype``.

    ``scale`` holds the blocks the box touches (from block ``origin // block``), e.g.
    the whole grid for a whole tensor. A new tensor of ``q``'s shape.
    """
    if q.ndim != 2 or scale.ndim != 2:
        raise ConversionError(f"FP8 weights and scales must be 2-d, got {tuple(q.shape)}")
    box = Box._trusted(((origin[0], origin[0] + q.shape[0]), (origin[1], origin[1] + q.shape[1])))
    want = _blocks_of(box, block).shape
    if tuple(scale.shape) != want:
        raise ConversionError(
            f"the scales of an FP8 box {box} hold {tuple(scale.shape)} blocks, its "
            f"{block[0]}x{block[1]} blocks are {want}; the checkpoint's weight_scale_inv does "
            "not match its weight and weight_block_size"
        )
    x = q.to(torch.float32)
    rows = _row_scales(scale.to(torch.float32), block[0], origin[0], q.shape[0])
    _scale_columns(x, rows, block[1], origin[1], divide=False)
    return x.to(dtype)


@beartype
def block_amax(x: Tensor, *, block: tuple[int, int], origin: tuple[int, int] = (0, 0)) -> Tensor:
    """The largest magnitude (float32) of ``x`` in each block it touches, ``x`` being a box
    of the tensor starting at ``origin``; for a block the box cuts, the part it holds."""
    (r0, c0), (bm, bn) = origin, block
    box = Box._trusted(((r0, r0 + x.shape[0]), (c0, c0 + x.shape[1])))
    grid = _blocks_of(box, block)
    (g0, g1), (h0, h1) = grid.ranges
    if (g0 * bm, h0 * bn) == (r0, c0) and x.shape == ((g1 - g0) * bm, (h1 - h0) * bn):
        return x.abs().view(g1 - g0, bm, h1 - h0, bn).amax(dim=(1, 3)).to(torch.float32)
    padded = torch.zeros((g1 - g0) * bm, (h1 - h0) * bn, dtype=torch.float32)
    at = (r0 - g0 * bm, c0 - h0 * bn)
    padded[at[0] : at[0] + x.shape[0], at[1] : at[1] + x.shape[1]] = x.abs()
    return padded.view(g1 - g0, bm, h1 - h0, bn).amax(dim=(1, 3))


@beartype
def quantize_fp8(
    x: Tensor,
    amax: Tensor,
    *,
    block: tuple[int, int],
    origin: tuple[int, int] = (0, 0),
    name: str = "tensor",
) -> tuple[Tensor, Tensor]:
    """FP8 values and scales of ``x`` (a box from ``origin``), ``amax`` being the whole
    blocks' largest magnitudes (:func:`block_amax` of the whole tensor, or the plan's
    maximum over a cut block's holders): ``scale = amax / 448`` (1 where 0) and
    ``q = clamp(x.float() / scale, -448, 448)`` as ``float8_e4m3fn``. Non-finite values
    are refused (``ConversionError`` naming ``name``)."""
    if not bool(torch.isfinite(amax).all()):
        raise ConversionError(
            f"{name} holds non-finite values (inf or nan), which FP8 cannot store; fix the "
            "weights or write the checkpoint without FP8"
        )
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    y = x.to(torch.float32, copy=True)
    rows = _row_scales(scale, block[0], origin[0], x.shape[0])
    _scale_columns(y, rows, block[1], origin[1], divide=True)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# -- shards that cut blocks ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Fp8BlockUse:
    """Block ``index`` (block row, block column) as one rank's box touches it."""

    index: tuple[int, int]
    #: the part of the block in the rank's box (tensor coordinates)
    region: Box
    #: the ranks whose boxes touch the block: its amax is the maximum of their partial
    #: amaxes (the rank's own alone when it holds the whole block)
    holders: tuple[int, ...]

    @property
    def writer(self) -> int:
        """The rank that writes this block's scale: the first holder."""
        return self.holders[0]

    @property
    def cut(self) -> bool:
        return len(self.holders) > 1


@attrs.frozen(kw_only=True)
class Fp8ShardPlan:
    """How the ranks holding the boxes ``boxes`` of a weight quantise it (see the module)."""

    shape: tuple[int, int]
    block: tuple[int, int]
    boxes: tuple[Box, ...]
    #: per rank, the blocks its box touches, row-major
    uses: tuple[tuple[Fp8BlockUse, ...], ...]

    def scale_box(self, rank: int) -> Box:
        """The block indices of ``rank``'s box: the ``amax`` it passes to
        :func:`quantize_fp8` and the scales that returns."""
        return _blocks_of(self.boxes[rank], self.block)

    def cut(self, rank: int) -> tuple[Fp8BlockUse, ...]:
        """The blocks ``rank`` shares with other ranks (whose amax it exchanges)."""
        return tuple(u for u in self.uses[rank] if u.cut)

    def bytes(self, rank: int) -> int:
        """What ``rank`` writes: one byte per value, four per scale it writes."""
        scales = sum(1 for u in self.uses[rank] if u.writer == rank)
        return self.boxes[rank].numel + 4 * scales

    @property
    def cut_blocks(self) -> tuple[tuple[int, int], ...]:
        """Every block more than one rank touches, row-major: the blocks whose amax the
        holders exchange (the only exchange quantising needs)."""
        return tuple(sorted({u.index for uses in self.uses for u in uses if u.cut}))

    def combine(self, partial: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """Every rank's ``amax`` over its :meth:`scale_box` from every rank's partial
        :func:`block_amax`: a cut block's is the maximum over its holders' (what an
        all-reduce ``MAX`` among them computes)."""
        whole: dict[tuple[int, int], Tensor] = {}
        for r, uses in enumerate(self.uses):
            g = self.scale_box(r)
            for u in uses:
                v = partial[r][u.index[0] - g.ranges[0][0], u.index[1] - g.ranges[1][0]]
                whole[u.index] = v if u.index not in whole else torch.maximum(whole[u.index], v)
        out = {}
        for r, uses in enumerate(self.uses):
            g = self.scale_box(r)
            out[r] = torch.stack([whole[u.index] for u in uses]).view(g.shape)
        return out


def _check_tiling(shape: tuple[int, int], boxes: Sequence[Box]) -> None:
    full = Box.full(shape)
    outside = [i for i, b in enumerate(boxes) if b.ndim != 2 or not full.contains(b)]
    if outside:
        raise PlanError(
            f"boxes of ranks {outside} are not boxes of the {shape[0]}x{shape[1]} weight; "
            "pass each rank's box of the tensor"
        )
    covered = sum(b.numel for b in boxes)
    overlap = [
        (i, j)
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i].intersect(boxes[j]) is not None
    ]
    if overlap or covered != full.numel:
        raise PlanError(
            f"the boxes must tile the {shape[0]}x{shape[1]} weight once: their sizes add up "
            f"to {covered} elements, the weight has {full.numel}; overlapping pairs "
            f"{overlap[:4]}; pass one "
            "box per writing rank (one replica of each element)"
        )


@beartype
def plan_fp8_shards(
    shape: tuple[int, int], boxes: Sequence[Box], *, block: tuple[int, int]
) -> Fp8ShardPlan:
    """The plan of ranks ``0..len(boxes)-1`` quantising a weight of ``shape``, rank ``r``
    holding ``boxes[r]`` (they tile the weight once; ``PlanError`` otherwise)."""
    _check_tiling(shape, boxes)
    touched: dict[tuple[int, int], list[int]] = {}
    for r, b in enumerate(boxes):
        if b.is_empty:
            continue
        (g0, g1), (h0, h1) = _blocks_of(b, block).ranges
        for i in range(g0, g1):
            for j in range(h0, h1):
                touched.setdefault((i, j), []).append(r)
    uses = []
    for b in boxes:
        mine = []
        if not b.is_empty:
            (g0, g1), (h0, h1) = _blocks_of(b, block).ranges
            for i in range(g0, g1):
                for j in range(h0, h1):
                    cell = Box._trusted(
                        ((i * block[0], (i + 1) * block[0]), (j * block[1], (j + 1) * block[1]))
                    )
                    region = b.intersect(cell)
                    assert region is not None
                    mine.append(
                        Fp8BlockUse(index=(i, j), region=region, holders=tuple(touched[(i, j)]))
                    )
        uses.append(tuple(mine))
    return Fp8ShardPlan(shape=shape, block=block, boxes=tuple(boxes), uses=tuple(uses))


@beartype
def fp8_checkpoint_bytes(model: ModelSpec, fmt: Fp8Format) -> tuple[int, int]:
    """Bytes of ``model``'s tensors in an FP8 checkpoint of ``fmt`` (quantised weights:
    one byte per value and four per block scale; the rest in their dtype), and in its
    own dtype."""
    fp8 = plain = 0
    for t in model.tensors:
        size = torch_dtype(t.dtype).itemsize
        n = Box.full(t.shape).numel
        plain += n * size
        if is_fp8_quantized(t.name, t.shape, fmt):
            rows, cols = scale_grid((t.shape[0], t.shape[1]), fmt.block)
            fp8 += n + 4 * rows * cols
        else:
            fp8 += n * size
    return fp8, plain
