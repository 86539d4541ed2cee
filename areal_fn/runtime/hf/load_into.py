"""An HF checkpoint straight into the tensors that will hold it (an engine's parameters).

:func:`hf_views` maps every tensor of an HF safetensors checkpoint (``model.safetensors``
or shards with their index) to a zero-copy view of a private memory map of its file
(:func:`~areal_fn.runtime.hf.convert.read_local`): nothing is read until a slice is
touched. :func:`load_into` writes one rank's local tensors of a layout into existing
tensors (``out``: name -> tensor, e.g. a model's parameters), each piece straight into
its view of the destination (:func:`~areal_fn.plans.convert.pieces_into`): a CPU
destination of the checkpoint's dtype is filled by ``preadv`` from the file (the
columns a piece does not hold go to a scratch buffer of one row), anything else (a cast,
another device) by one ``copy_`` from the memory-mapped slice. Each needed byte is copied
once, no tensor is allocated, padding rows are zeroed in place.

A quantised checkpoint (``quantization_config`` ``quant_method`` ``fp8``: block FP8;
``mxfp4``: gpt-oss's experts) is read as its config's ``torch_dtype``: each piece of a
quantised weight is its box of values and the scales of its blocks, dequantised
(:mod:`~areal_fn.runtime.hf.fp8_io`, :mod:`~areal_fn.runtime.hf.mxfp4_io`), then copied.

Checked before the first write: the checkpoint's names and shapes against the layout,
the destinations' names, shapes, storage (not ``meta``, not a ``DTensor``: pass its
``to_local()``) and, without ``cast=True``, dtypes.
"""

import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from areal_fn.errors import ConversionError
from areal_fn.layouts.layout import Layout, Piece
from areal_fn.plans.convert import canonical_region, check_canonical, check_into, pieces_into
from areal_fn.plans.tensor_check import listing
from areal_fn.runtime.hf.convert import read_local
from areal_fn.runtime.hf.fp8_io import Quantized, quantized_weights
from areal_fn.runtime.hf.io import INDEX, SINGLE, HfCheckpoint, read_safetensors_header
from areal_fn.runtime.hf.text_model import TextView
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

__all__ = ["hf_views", "load_into"]

_PathLike = str | os.PathLike[str]


@beartype
def hf_views(src_hf_dir: _PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the HF checkpoint in ``src_hf_dir`` as a zero-copy memory-mapped view.

    The views are copy-on-write: writing to one never reaches the file. Those of an FP8
    checkpoint are what it stores (``float8_e4m3fn`` values and ``weight_scale_inv``
    scales); :meth:`HfCheckpoint.read <areal_fn.runtime.hf.io.HfCheckpoint.read>` and
    :func:`load_into` dequantise them. The maps live
    as long as the views. A sharded checkpoint's index must name, for every tensor, a
    file that holds it. A multimodal checkpoint's text model is keyed by its canonical
    names, the rest by the names stored (:mod:`~areal_fn.runtime.hf.text_model`).
    """
    return _views(Path(src_hf_dir))[0]


def _views(base: Path) -> tuple[dict[str, torch.Tensor], TextView]:
    """:func:`hf_views` of ``base``, and how its stored names read as the text model's."""
    with HfCheckpoint(base) as ckpt:  # checks the directory and its index
        names, files, text = ckpt.stored, [f for f in ckpt.files if f != INDEX], ckpt.text
    if (base / INDEX).exists():
        file_of: dict[str, str] = dict(json.loads((base / INDEX).read_text())["weight_map"])
    else:
        file_of = dict.fromkeys((text.stored(n) for n in names), SINGLE)
    by_file = {f: read_local(base / f) for f in files}
    lost = [f"{n} ({f})" for n, f in file_of.items() if n not in by_file[f]]
    if lost:
        raise ConversionError(
            f"{base / INDEX} names files that do not hold the tensors it maps to them: "
            f"{listing(lost)}; the checkpoint is inconsistent: download or save it again"
        )
    return {text.name(name): by_file[f][name] for name, f in file_of.items()}, text


def _check_plain(out: Mapping[str, torch.Tensor]) -> None:
    sharded = [n for n, t in out.items() if isinstance(t, DTensor)]
    if sharded:
        raise ConversionError(
            f"destinations {listing(sharded)} are DTensors, whose shape is the global one; "
            "pass each one's local shard (t.to_local()), as the layout's local tensors are"
        )


class _Files:
    """Open weight files and where each canonical tensor's bytes start in its file."""

    def __init__(self, base: Path, views: Mapping[str, torch.Tensor], text: TextView) -> None:
        self.fds: dict[str, int] = {}
        self.where: dict[str, tuple[int, int]] = {}  # name -> (fd, first byte)
        headers: dict[str, tuple[dict[str, Any], int, int]] = {}
        for name, f in _file_map(base, views, text).items():
            if f not in self.fds:
                headers[f] = read_safetensors_header(base / f)
                self.fds[f] = os.open(base / f, os.O_RDONLY)
            header, data_start, _ = headers[f]
            begin = int(header[text.stored(name)]["data_offsets"][0])
            self.where[name] = (self.fds[f], data_start + begin)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _file_map(base: Path, views: Mapping[str, torch.Tensor], text: TextView) -> dict[str, str]:
    """Canonical name -> the file holding it, file by file."""
    if (base / INDEX).exists():
        weight_map: dict[str, str] = json.loads((base / INDEX).read_text())["weight_map"]
        return {text.name(n): f for n, f in sorted(weight_map.items(), key=lambda kv: kv[1])}
    return dict.fromkeys(views, SINGLE)


def _preadv(fd: int, buffers: list[memoryview], offset: int, want: int) -> None:
    """Fill ``buffers`` (``want`` bytes) in order from ``offset`` of ``fd`` (a short read
    is continued)."""
    n = os.preadv(fd, buffers, offset)
    if n == want:
        return
    if n <= 0:
        raise ConversionError(f"a checkpoint file ended {want} bytes before its header says")
    i, skip = 0, n
    while skip >= len(buffers[i]):
        skip -= len(buffers[i])
        i += 1
    _preadv(fd, [buffers[i][skip:], *buffers[i + 1 :]], offset + n, want - n)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (shares its memory)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


_IOV = 1000  # below IOV_MAX (1024 on Linux)


def _read_rows(fd: int, start: int, region: torch.Tensor, full: tuple[int, ...], box: Box) -> None:
    """Rows ``box`` of a 2-d tensor of shape ``full`` (first byte at ``start``) into
    ``region``, whose rows are contiguous: one ``preadv`` per batch of rows, the columns
    outside the box read into a small scratch buffer."""
    item = region.element_size()
    (r0, r1), (c0, c1) = box.ranges
    row, width = full[1] * item, (c1 - c0) * item
    junk = memoryview(bytearray((full[1] - (c1 - c0)) * item))
    rows = region.reshape(box.shape)
    storage = _storage_bytes(rows)
    first, step = rows.storage_offset() * item, rows.stride(0) * item
    for b0 in range(r0, r1, _IOV // 3):
        bufs: list[memoryview] = []
        b1 = min(r1, b0 + _IOV // 3)
        for r in range(b0, b1):
            if c0:
                bufs.append(junk[: c0 * item])
            at = first + (r - r0) * step
            bufs.append(storage[at : at + width])
            if c1 < full[1]:
                bufs.append(junk[: (full[1] - c1) * item])
        _preadv(fd, bufs, start + b0 * row, (b1 - b0) * row)


def _storage_bytes(t: torch.Tensor) -> memoryview:
    """All bytes of the CPU storage under ``t`` (shares its memory)."""
    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return whole.numpy().data


def _direct(region: torch.Tensor, view: torch.Tensor, box: Box) -> bool:
    """Whether ``box`` of ``view`` can be read by ``preadv`` straight into ``region``."""
    if region.device.type != "cpu" or region.dtype != view.dtype or view.ndim > 2:
        return False
    if view.ndim == 2 and box.ranges[1] != (0, view.shape[1]):
        return region.reshape(box.shape).stride(-1) == 1 and region.numel() > 0
    return region.is_contiguous()


def _fill(
    files: _Files, views: Mapping[str, torch.Tensor], region: torch.Tensor, name: str, box: Box
) -> None:
    view = views[name]
    if not _direct(region, view, box):
        region.copy_(view[box.slices()].reshape(region.shape))
        return
    fd, start = files.where[name]
    if view.ndim == 2 and box.ranges[1] != (0, view.shape[1]):
        _read_rows(fd, start, region, tuple(view.shape), box)
        return
    inner = view[0].numel() if view.ndim else 1
    first = box.ranges[0][0] if view.ndim else 0
    whole = _bytes_of(region)
    _preadv(fd, [whole], start + first * inner * view.element_size(), len(whole))


def _dequantized(q: Quantized, views: Mapping[str, torch.Tensor], p: Piece) -> torch.Tensor:
    """Piece ``p`` of a quantised weight: the box around it dequantised (its view taken)."""
    assert p.canonical is not None and p.canonical_region is not None
    name = p.canonical
    box = p.canonical_region
    if p.view is not None:
        box = Box.full(q.shape(name, lambda n: tuple(views[n].shape)))
    values = q.read(name, box, lambda n, b: views[n][b.slices()])
    return values if p.view is None else canonical_region(values, p)


@beartype
def load_into(
    src_hf_dir: _PathLike,
    layout: Layout,
    rank: int,
    *,
    out: Mapping[str, torch.Tensor],
    cast: bool = False,
    threads: int | None = None,
    text_only: bool = False,
) -> int:
    """Write ``rank``'s local tensors of ``layout``, read from the HF checkpoint in
    ``src_hf_dir``, into the existing tensors ``out`` (layout name -> tensor); the
    bytes written.

    Each piece goes from the file straight into the destination's storage: read by
    ``preadv`` into it (a CPU destination of the checkpoint's dtype whose piece rows are
    contiguous), else one ``copy_`` from the memory-mapped file (:func:`hf_views`), cast
    as it is copied with ``cast=True``. No intermediate tensor. Without ``cast`` each
    destination must have the checkpoint's dtype. Everything is checked before the first
    write (see the module docstring). The pieces are read on ``threads`` threads
    (default ``torch.get_num_threads()``), largest first; they write disjoint regions.
    A multimodal checkpoint is read as its text model; the tensors that are not (the
    vision encoder, ``mtp.*``) are refused, listed, unless ``text_only=True`` leaves
    them out (:meth:`~areal_fn.runtime.hf.text_model.TextView.left_out`).
    """
    if threads is not None and threads < 1:
        raise ConversionError(f"threads={threads} must be >= 1 (or None: torch's thread count)")
    _check_plain(out)
    views, text = _views(Path(src_hf_dir))
    left = set(text.left_out(text_only=text_only))
    q = quantized_weights(
        Path(src_hf_dir),
        tuple(views),
        lambda n: tuple(views[n].shape),
        lambda n: str(views[n].dtype),
    )
    stored = {n: v for n, v in views.items() if (q is None or n not in q.hidden) and n not in left}
    shown = dict(stored)
    dtypes = {n: v.dtype for n, v in stored.items()}
    if q is not None:
        for n in q.names:
            shown[n] = torch.empty(q.shape(n, lambda m: tuple(views[m].shape)), device="meta")
            dtypes[n] = q.dtype
    check_canonical(shown, layout.canonical)
    check_into(layout, rank, out, dtypes=dtypes, cast=cast)
    files = _Files(Path(src_hf_dir), stored, text)
    jobs = sorted(pieces_into(layout, rank, out), key=lambda job: -job[1].numel())

    def run(job: tuple[str, torch.Tensor, Piece]) -> None:
        _, region, p = job
        with torch.no_grad():
            if p.canonical is None or p.canonical_region is None:
                region.zero_()
            elif q is not None and p.canonical in q.names:  # dequantised as read
                region.copy_(_dequantized(q, views, p).reshape(region.shape))
            elif p.view is not None:  # strided / transposed (gpt-oss experts): one copy_
                region.copy_(canonical_region(views[p.canonical], p).reshape(region.shape))
            else:
                _fill(files, views, region, p.canonical, p.canonical_region)

    workers = torch.get_num_threads() if threads is None else threads
    try:
        if workers <= 1:
            for job in jobs:
                run(job)
        else:  # pieces are disjoint regions; preadv and copy_ release the GIL
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(run, jobs))
    finally:
        files.close()
    return sum(
        out[lt.name].numel() * out[lt.name].element_size() for lt in layout.local_tensors(rank)
    )
