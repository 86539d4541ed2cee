"""Apply a transfer plan to tensors held in one process (no communication).

The reference semantics of a plan, and the one place that copies a transfer's box:
:func:`apply_transfers` (every rank in one process: the laws, simulated ranks) is
made of :func:`copy_box`, and the runtime executor
(:mod:`areal_fn.runtime.sync.executor`) uses the same helpers for its local
(colocated) copies and for the boxes it packs into, and unpacks from, one flat byte
buffer per message (:func:`pack_boxes`, :func:`unpack_boxes`); so the executor gives
the same result. Autograd is the caller's business (the executor runs these under
``torch.no_grad()``).
"""

from collections.abc import Iterable, Mapping, MutableMapping, Sequence

import torch
from jaxtyping import UInt8
from torch import Tensor

from areal_fn.errors import PlanError
from areal_fn.layouts.lift import LocalView, viewed
from areal_fn.plans.transfer.plan import Transfer

#: a flat byte buffer that boxes are packed into
Bytes = UInt8[Tensor, "nbytes"]


def apply_transfers(
    transfers: Iterable[Transfer],
    src_tensors: Mapping[int, Mapping[str, Tensor]],
    dst_tensors: MutableMapping[int, MutableMapping[str, Tensor]],
    *,
    src_views: Sequence[tuple[str, LocalView]] = (),
    dst_views: Sequence[tuple[str, LocalView]] = (),
) -> int:
    """Copy every transfer's source box into its destination box; returns bytes copied.

    ``src_views`` / ``dst_views``: a plan's views of the local tensors
    (:class:`~areal_fn.plans.transfer.plan.TransferPlan`), applied before the boxes index them.
    """
    total = 0
    views = {"source": dict(src_views), "destination": dict(dst_views)}
    for t in transfers:
        try:
            s = src_tensors[t.src][t.src_tensor]
            d = dst_tensors[t.dst][t.dst_tensor]
        except KeyError as e:
            raise PlanError(
                f"transfer {t} names a tensor or rank that is not present: {e}"
            ) from None
        s = viewed(views["source"], t.src_tensor, s, "source tensor", PlanError)
        d = viewed(views["destination"], t.dst_tensor, d, "destination tensor", PlanError)
        copy_box(s, d, t)
        total += t.nbytes
    return total


def with_views(
    views: Sequence[tuple[str, LocalView]], tensors: Mapping[str, Tensor], role: str
) -> dict[str, Tensor]:
    """Every tensor of ``tensors`` through its view, if it has one (by name)."""
    by_name = dict(views)
    return {
        name: viewed(by_name, name, t, f"{role} tensor", PlanError) for name, t in tensors.items()
    }


def copy_box(src: Tensor, dst: Tensor, transfer: Transfer) -> None:
    """Copy ``transfer``'s source box of ``src`` into its destination box of ``dst`` (in place)."""
    _fill(dst[transfer.dst_box.slices()], src[transfer.src_box.slices()])


def pack_boxes(
    transfers: Sequence[Transfer],
    src_tensors: Mapping[str, Tensor],
    buffer: Bytes,
    *,
    offsets: Sequence[int],
    dtypes: Sequence[torch.dtype],
) -> None:
    """Write each transfer's source box into the byte ``buffer`` at its offset, as its dtype.

    ``buffer`` is a 1-D ``uint8`` tensor; each box lands contiguous (row-major) at
    ``offsets[i]``, cast to ``dtypes[i]``: the layout :func:`unpack_boxes` reads back.
    The offsets must be aligned to the dtypes' sizes and leave room for every box.
    """
    for t, dtype, off in zip(transfers, dtypes, offsets, strict=True):
        _fill(_segment(buffer, off, dtype, t), src_tensors[t.src_tensor][t.src_box.slices()])


def unpack_boxes(
    transfers: Sequence[Transfer],
    buffer: Bytes,
    dst_tensors: Mapping[str, Tensor],
    *,
    offsets: Sequence[int],
    dtypes: Sequence[torch.dtype],
) -> None:
    """Copy each transfer's box, packed by :func:`pack_boxes`, into its destination box."""
    for t, dtype, off in zip(transfers, dtypes, offsets, strict=True):
        _fill(dst_tensors[t.dst_tensor][t.dst_box.slices()], _segment(buffer, off, dtype, t))


def _segment(buffer: Bytes, offset: int, dtype: torch.dtype, t: Transfer) -> Tensor:
    """The bytes of ``t``'s box in ``buffer`` at ``offset``, viewed as ``dtype`` of its shape."""
    n = t.box.numel * dtype.itemsize
    return buffer[offset : offset + n].view(dtype).view(t.src_box.shape)


def _fill(region: Tensor, values: Tensor) -> None:
    """``region`` (a view) takes ``values``, which hold as many elements in row-major order."""
    region.copy_(values.reshape(region.shape))
