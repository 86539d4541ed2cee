"""torch DCP plumbing for canonical checkpoints: save/load planners over canonical boxes and a
reader that copies chunk bytes straight into destination views."""

import io
import itertools
import math
import os
import re
import struct
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from areal_fn.errors import CheckpointError, SpecError
from areal_fn.layouts.lift import LocalView, viewed
from areal_fn.sharding.box import Box

#: what to do about a damaged file of a checkpoint
_REMEDY = "restore it from a copy or use another checkpoint"

# -- DCP planners --------------------------------------------------------------------


class _SavePlanner(DefaultSavePlanner):
    """Writes exactly the given items (DCP's global plan merges and validates them)."""

    def __init__(
        self, items: list[WriteItem], data: dict[MetadataIndex, Callable[[], Any]]
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = items
        self._data = data

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> "torch.Tensor | io.BytesIO":
        return self._data[write_item.index]()


class _LoadPlanner(LoadPlanner):
    """Reads exactly the given items into the given destination views."""

    def __init__(
        self, items: list[ReadItem], dests: "Sequence[torch.Tensor | _Reshaped]", source: str
    ) -> None:
        self._items = items
        self._dests = dests
        self._source = source
        self.blobs: dict[str, bytes] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # by destination: a _Reshaped's buffer

    def set_up_planner(
        self, state_dict: Any, metadata: "Metadata | None" = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is not None:
            stored = self.metadata.state_dict_metadata
            missing = sorted(
                {i.storage_index.fqn for i in self._items if i.storage_index.fqn not in stored}
            )
            if missing:
                raise CheckpointError(
                    f"{self._source}: DCP metadata lacks {len(missing)} entries the manifest lists, e.g. "
                    f"{missing[:3]}; the checkpoint is inconsistent"
                )
        return LoadPlan(self._items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = value.getvalue()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        i = read_item.dest_index.index
        assert i is not None
        dest = self._dests[i]
        if isinstance(dest, _Reshaped):  # read into a buffer, copied in at commit
            buf = torch.empty(dest.shape, dtype=dest.dtype, device=dest.region.device)
            self._buffers[i] = buf
            return buf
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        i = read_item.dest_index.index
        buf = self._buffers.pop(i, None) if i is not None else None
        if buf is not None:
            dest = self._dests[i]  # type: ignore[index]
            assert isinstance(dest, _Reshaped)
            dest.region.copy_(buf.view(dest.region.shape))


class _Window:
    """A read-only file view of ``length`` bytes at ``base`` (for ``zipfile``)."""

    def __init__(self, f: Any, base: int, length: int) -> None:
        self._f, self._base, self._len, self._pos = f, base, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = min(self._len, max(0, pos + (0, self._pos, self._len)[whence]))
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._len - self._pos if n is None or n < 0 else min(n, self._len - self._pos)
        self._f.seek(self._base + self._pos)
        data: bytes = self._f.read(n)
        self._pos += len(data)
        return data


_DATA_RECORD = re.compile(r"^[^/]+/data/\d+$")


def _raw_offset(f: Any, base: int, length: int, nbytes: int) -> int | None:
    """File offset of the raw bytes of the one tensor ``torch.save`` stored at ``base``.

    ``torch.save`` writes an uncompressed zip whose ``<archive>/data/0`` record holds the
    storage; ours are contiguous tensors owning exactly their storage, so the record is
    the chunk in row-major order. None when the record is not what that predicts.
    """
    win = _Window(f, base, length)
    try:
        records = [i for i in zipfile.ZipFile(win).infolist() if _DATA_RECORD.match(i.filename)]  # type: ignore[arg-type]
    except zipfile.BadZipFile:
        return None
    if len(records) != 1:
        return None
    rec = records[0]
    if rec.compress_type != zipfile.ZIP_STORED or rec.file_size != nbytes:
        return None
    win.seek(rec.header_offset)
    head = win.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return base + rec.header_offset + 30 + name_len + extra_len


def _read_exact(f: Any, offset: int, dest: torch.Tensor, what: str) -> None:
    view = dest.reshape(-1).view(torch.uint8).numpy().data
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{what}: the file ends early; it is truncated: {_REMEDY}")
        done += n


def _reason(e: BaseException) -> str:
    """``Type: first line of the message`` (library messages can run over many lines)."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first[:200]}{'...' if len(first) > 200 else ''}"


def dcp_failure(e: BaseException) -> BaseException:
    """The exception behind a torch DCP ``CheckpointException`` (a ``BaseException`` that
    wraps what each rank raised), else ``e``; the ``OSError`` behind it when there is one
    (``torch.save`` onto a full disk raises ``RuntimeError: ... unexpected pos``)."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None or isinstance(e, SpecError):
            break
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def dcp_error(e: BaseException) -> str:
    """One line saying what went wrong in a DCP call: our own message, else type and message."""
    cause = dcp_failure(e)
    return str(cause) if isinstance(cause, SpecError) else _reason(cause)


class _ChunkReader(FileSystemReader):
    """DCP's file reader, reading each stored chunk once per call (in file order) however
    many requests it serves, straight from its bytes in the file: into the destination
    when one request takes the whole chunk, else into one buffer. (DCP's own reader
    deserialises the chunk again for every request.) ``raw=False`` always goes through
    ``torch.load(weights_only=True)``: for files we did not write (their tensors may be
    strided views).

    ``metadata`` is DCP's metadata, given (built from the manifest, see
    :mod:`~areal_fn.runtime.checkpoint.metadata`): this reader never reads ``.metadata``,
    a pickle."""

    def __init__(
        self, path: "str | os.PathLike[str]", *, metadata: Metadata, raw: bool = True
    ) -> None:
        super().__init__(path)
        self._raw = raw
        self._metadata = metadata
        #: whether a destination tensor was written to (a failed read may leave it partly written)
        self.touched = False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata given (DCP's own reader would unpickle ``.metadata`` here)."""
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._md = metadata

    def _chunk(self, key: MetadataIndex) -> tuple[torch.dtype, torch.Size]:
        md = self._md.state_dict_metadata[key.fqn]
        assert isinstance(md, TensorStorageMetadata)
        offsets = key.offset if key.offset is not None else torch.Size(())
        for c in md.chunks:
            if c.offsets == offsets:
                return md.properties.dtype, c.sizes
        raise CheckpointError(f"DCP metadata has no chunk of {key.fqn} at {tuple(offsets)}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        infos = self.storage_data
        if any(infos[i.storage_index].transform_descriptors for i in plan.items):
            self.touched = True
            try:
                return super().read_data(plan, planner)
            except Exception as e:
                raise CheckpointError(
                    f"{self.path} cannot be read ({_reason(e)}); a file is corrupted: {_REMEDY}"
                ) from None
        groups: dict[MetadataIndex, list[ReadItem]] = {}
        for item in plan.items:
            groups.setdefault(item.storage_index, []).append(item)
        order = sorted(groups, key=lambda k: (infos[k].relative_path, infos[k].offset))
        for rel, keys in itertools.groupby(order, key=lambda k: infos[k].relative_path):
            path = Path(self.path) / rel
            key: MetadataIndex | None = None
            try:
                with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:
                    for key in keys:
                        self._serve(stream, str(path), key, groups[key], planner)
            except SpecError:
                raise
            except Exception as e:
                what = f"{path} ({key.fqn})" if key is not None else str(path)
                raise CheckpointError(
                    f"{what} cannot be read ({_reason(e)}); the file is corrupted: {_REMEDY}"
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _serve(
        self, stream: Any, path: str, key: MetadataIndex, reqs: list[ReadItem], planner: LoadPlanner
    ) -> None:
        info = self.storage_data[key]
        what = f"{path} ({key.fqn})"
        if reqs[0].type == LoadItemType.BYTE_IO:
            stream.seek(info.offset)
            data = stream.read(info.length)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        dtype, shape = self._chunk(key)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = _raw_offset(stream, info.offset, info.length, nbytes) if self._raw else None
        dests = [planner.resolve_tensor(req).detach() for req in reqs]
        if raw is not None and len(shape) and sum(r.lengths[0] for r in reqs) < shape[0]:
            # the requests take fewer rows than the chunk has: read only their rows
            row = nbytes // shape[0]
            for req, dest in zip(reqs, dests, strict=True):
                first, rows = req.storage_offsets[0], req.lengths[0]
                part = torch.Size((rows, *shape[1:]))
                if (
                    tuple(dest.shape) == tuple(part)
                    and dest.dtype == dtype
                    and dest.is_contiguous()
                ):
                    self.touched = True
                    _read_exact(stream, raw + first * row, dest, what)  # rows -> destination
                else:
                    buf = torch.empty(part, dtype=dtype)
                    _read_exact(stream, raw + first * row, buf, what)
                    src = buf
                    for d in range(1, len(shape)):
                        src = src.narrow(d, req.storage_offsets[d], req.lengths[d])
                    self.touched = True
                    dest.copy_(src)
                planner.commit_tensor(req, dest)
            return
        if raw is not None and len(reqs) == 1:
            dest = dests[0]
            if tuple(dest.shape) == tuple(shape) and dest.dtype == dtype and dest.is_contiguous():
                self.touched = True
                _read_exact(stream, raw, dest, what)  # one copy: file -> destination
                planner.commit_tensor(reqs[0], dest)
                return
        if raw is not None:
            stored = torch.empty(shape, dtype=dtype)
            _read_exact(stream, raw, stored, what)
        else:
            if not zipfile.is_zipfile(_Window(stream, info.offset, info.length)):  # type: ignore[arg-type]
                raise CheckpointError(
                    f"{what}: the {info.length} bytes at offset {info.offset} are not a "
                    f"torch.save archive; the file is corrupted: {_REMEDY}"
                )
            stream.seek(info.offset)
            stored = torch.load(
                io.BytesIO(stream.read(info.length)), map_location="cpu", weights_only=True
            )
        for req, dest in zip(reqs, dests, strict=True):
            src = stored
            for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                src = src.narrow(d, o, n)
            if dest.shape != src.shape:
                raise CheckpointError(
                    f"{key.fqn}: stored piece has shape {tuple(src.shape)}, its destination {tuple(dest.shape)}"
                )
            self.touched = True
            dest.copy_(src)
            planner.commit_tensor(req, dest)


def _read_into(
    items: list[ReadItem],
    dests: "list[torch.Tensor | _Reshaped]",
    key: str,
    box: Box,
    chunk: Box,
    dest: "torch.Tensor | _Reshaped",
) -> None:
    """Append the read of ``box`` of stored entry ``key`` (inside its stored chunk
    ``chunk``) into ``dest`` (a view of the box, or a :class:`_Reshaped` region)."""
    items.append(
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(key, box.start, index=len(dests)),
            dest_offsets=torch.Size([0] * box.ndim),
            storage_index=MetadataIndex(key, chunk.start),
            storage_offsets=torch.Size(b - c for b, c in zip(box.start, chunk.start, strict=True)),
            lengths=torch.Size(box.shape),
        )
    )
    dests.append(dest)


def _write_item(key: str, box: Box, shape: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
    offsets = torch.Size(box.start)
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD if shape else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.shape)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a CPU tensor that owns exactly its storage (``torch.save`` writes whole storages)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu", copy=True).contiguous()
    if (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _Reshaped:
    """A local region whose elements, row-major, are a canonical box of another shape,
    and that no view of that shape reaches (a lifted, permuted view of a strided
    parameter): saved through a copy made when written, loaded through a buffer."""

    def __init__(self, region: torch.Tensor, shape: tuple[int, ...]) -> None:
        self.region, self.shape, self.dtype = region, shape, region.dtype

    def copy(self) -> torch.Tensor:
        """The region's elements in the box's shape, in memory of their own."""
        return _owned(self.region.reshape(self.shape))


def _piece_view(t: torch.Tensor, local_box: Box, box: Box) -> "torch.Tensor | _Reshaped":
    region = t[local_box.slices()]
    if region.shape == box.shape:
        return region
    try:
        return region.view(box.shape)
    except RuntimeError:  # the region is a permuted view: not viewable in the box's shape
        return _Reshaped(region, box.shape)


def _viewed(
    views: Mapping[str, LocalView], name: str, tensor: torch.Tensor, what: str
) -> torch.Tensor:
    """Local tensor ``name`` seen through its view in ``views``, if it has one (a layout
    with strided pieces: :class:`~areal_fn.plans.checkpoint.write.WritePlan.views`)."""
    return viewed(views, name, tensor, what, CheckpointError)


@contextmanager
def _single_process_dcp(on: bool) -> Iterator[None]:
    """DCP warns when asked (on purpose) to work without a process group: silence that only."""
    if on:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes, what: str) -> Any:
    """A byte entry (LR scheduler, RNG state): ``torch.load(weights_only=True)``, which
    builds plain data only and refuses any other import a pickle asks for."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{what} cannot be decoded ({_reason(e)}); a save writes plain data there (read "
            f"with weights_only=True, nothing else is run): the checkpoint is corrupted or was "
            f"made elsewhere: {_REMEDY}"
        ) from None
