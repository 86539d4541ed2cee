"""Reading a per-rank file of :mod:`areal_fn.runtime.hf.convert`: its header, its tensors."""

import mmap
import os
from pathlib import Path

import attrs
import torch

from areal_fn.errors import ConversionError
from areal_fn.runtime.hf.io import read_safetensors_header
from areal_fn.typecheck import beartype

_PathLike = str | os.PathLike[str]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@attrs.frozen(kw_only=True)
class _Header:
    path: Path
    metadata: tuple[tuple[str, str], ...]
    # name -> (dtype code, shape, (begin, end) byte offsets in the data section)
    entries: tuple[tuple[str, str, tuple[int, ...], tuple[int, int]], ...]
    data_start: int


def _header(path: Path) -> _Header:
    raw, data_start, _ = read_safetensors_header(path)
    try:
        meta = raw.pop("__metadata__", None) or {}
        entries = [
            (
                name,
                e["dtype"],
                tuple(int(d) for d in e["shape"]),
                (int(e["data_offsets"][0]), int(e["data_offsets"][1])),
            )
            for name, e in raw.items()
        ]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConversionError(
            f"{path} is not a readable safetensors file: its header lists a tensor without dtype, "
            f"shape and data_offsets ({exc!r}); the file is corrupted: convert it again"
        ) from None
    for name, code, _, _ in entries:
        if code not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {code}")
    return _Header(
        path=path,
        metadata=tuple(sorted((str(k), str(v)) for k, v in meta.items())),
        entries=tuple(entries),
        data_start=data_start,
    )


@beartype
def read_local(path: _PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a zero-copy view of a private memory map.

    Pages are read from disk only when touched, and stay file-backed (the OS can drop
    them); writing to a view never reaches the file. Falls back to a copy for a tensor
    whose offset is not aligned to its element size.
    """
    header = _header(Path(path))
    out: dict[str, torch.Tensor] = {}
    with open(header.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ConversionError(f"{header.path} is empty")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    for name, code, shape, (begin, end) in header.entries:
        dtype = _DTYPES[code]
        lo, hi = header.data_start + begin, header.data_start + end
        if hi > size:
            raise ConversionError(
                f"{header.path}: tensor {name!r} runs past the end of the file; the file is "
                "truncated: convert it again"
            )
        raw = buf[lo:hi]
        item = torch.empty((), dtype=dtype).element_size()
        if lo % item:
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(shape)
    return out
