"""torch DCP's file writer, writing each data file in one pass and keeping its checksum.

:class:`DigestingWriter` is DCP's ``FileSystemWriter`` (same files, same layout: one
``__<process>_<n>.distcp`` per writer thread, each entry a ``torch.save`` archive at the
offset DCP's metadata records) with its own ``write_data``: every file goes through a
:class:`~areal_fn.runtime.checkpoint.hashing.HashingWriter`, so its BLAKE3 is known
when its last byte is written, and a save never reads its files back. Tensors are
written as ``torch.save`` writes them, without the zip records' CRC-32 (the file's
BLAKE3 covers every byte; ``torch.load`` reads such archives, as torch documents for
``set_crc32_options(False)``), set per archive, never through torch's global option.
"""

import functools
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from areal_fn.runtime.checkpoint.hashing import HashingWriter

#: DCP's data file suffix
_SUFFIX = ".distcp"


def _item_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None:
        return 0
    return td.chunk.sizes.numel() * torch.empty((), dtype=td.properties.dtype).element_size()


def _buckets(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    """``items`` cut into ``n`` files as DCP cuts them (byte entries dealt round, tensors
    largest first into the lightest file), byte entries first in each file."""
    blobs = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
    if n == 1:
        return [blobs + tensors]
    out: list[list[WriteItem]] = [blobs[k::n] for k in range(n)]
    sizes = [0] * n
    for item in sorted(tensors, key=_item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        out[k].append(item)
        sizes[k] += _item_bytes(item)
    return out


def _save_without_crc(t: torch.Tensor, out: Any) -> None:
    """``torch.save(t, out)``, its zip writer told not to compute CRC-32s."""
    from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

    writer = torch._C.PyTorchFileWriter(out, False, _get_storage_alignment())
    try:
        _save(t, writer, pickle, DEFAULT_PROTOCOL, False)
    finally:  # as torch.save does: a writer left open would write again when collected
        writer.write_end_of_file()
    out.flush()


@functools.cache
def _crc_free() -> bool:
    """Whether this torch writes an archive without CRC-32s that ``torch.load`` reads back
    (private torch calls: checked once; otherwise tensors go through ``torch.save``)."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    buf = io.BytesIO()
    try:
        _save_without_crc(t, buf)
        back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:
        return False
    return isinstance(back, torch.Tensor) and torch.equal(back, t)


def save_tensor(t: torch.Tensor, out: Any) -> None:
    """``t`` (on CPU, owning exactly its storage) as a ``torch.save`` archive into ``out``."""
    if _crc_free():
        _save_without_crc(t, out)
    else:
        torch.save(t, out)


class DigestingWriter(FileSystemWriter):
    """DCP's file writer (one file per thread per process, every file fsync'ed) that
    hashes each data file as it writes it: ``digests`` maps each file this process
    wrote to its size and BLAKE3."""

    def __init__(self, path: Path, *, thread_count: int) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
        self.digests: dict[str, tuple[int, str]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        prefix = plan.storage_data.prefix
        jobs = [
            (f"{prefix}{k}{_SUFFIX}", bucket)
            for k, bucket in enumerate(_buckets(plan.items, self.thread_count))
        ]
        if len(jobs) == 1:
            results = [self._write_file(jobs[0][0], jobs[0][1], planner)]
        else:
            with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="dcp-write") as pool:
                results = list(
                    pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs)
                )
        done: Future[list[WriteResult]] = Future()
        done.set_result([r for rs in results for r in rs])
        return done

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        results = []
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "wb") as f, HashingWriter(cast(BinaryIO, f)) as out:
            for item in items:
                data = planner.resolve_data(item)
                start = out.tell()
                if isinstance(data, io.BytesIO):
                    out.write(data.getbuffer())
                else:
                    save_tensor(data, out)
                length = out.tell() - start
                info = _StorageInfo(relative_path=name, offset=start, length=length)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
                )
            out.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        self.digests[name] = (out.tell(), out.hexdigest())
        return results
