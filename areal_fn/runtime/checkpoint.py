"""Distributed checkpoints: canonical tensors in torch DCP storage, committed atomically.

Every rank writes the canonical boxes :func:`~areal_fn.checkpoint_plan.plan_save`
gives it (each element once, replicas deduplicated), as DCP chunks keyed by canonical
name (``model.layers.0.self_attn.q_proj.weight``) and ``optim/<canonical>/<state>``
for optimizer state; so any layout loads what any other layout saved. Next to DCP's
files sits ``manifest.json`` (:class:`~areal_fn.checkpoint_plan.CheckpointManifest`:
allocation, model config, tensors and chunks, optimizer, step, data position, sha256
of every file). A save::

    root/.tmp-step-00000012/   DCP writes here (every file fsync'ed), then the manifest
    root/step-00000012/        one rename once complete (and the directory fsync'ed)
    root/latest                "step-00000012", replaced atomically last

so a crash (even ``kill -9``) at any moment leaves the previous checkpoint loadable and
untouched; older ones beyond ``keep`` are renamed away and deleted after the commit.
Loading verifies the manifest and every file's checksum before reading, never opens
a file for writing, and writes into the caller's local tensors in place.

State is given per rank as :class:`RankState`: local tensors ``{name: tensor}`` as the
layout names them (for FSDP2 the DTensor locals) and optimizer state per local tensor
(``{name: {"exp_avg": t, "exp_avg_sq": t, "step": scalar}}``). Under ``torchrun`` each
process passes its own rank; without a process group one process may pass every rank
(offline conversion, tests).
"""

import functools
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import struct
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
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

from ..box import Box
from ..checkpoint_plan import (
    CheckpointManifest,
    Dedup,
    FileDigest,
    OptimizerSpec,
    SavedTensor,
    WritePlan,
    check_model,
    check_optimizer,
    make_manifest,
    optim_key,
    optimizer_spec,
    plan_load,
    plan_save,
)
from ..checkpoint_plan import (
    LoadPlan as PieceLoadPlan,
)
from ..errors import CheckpointError, SpecError
from ..layout import Layout
from ..model import ModelSpec
from ..tensor_spec import dtype_name, torch_dtype

__all__ = [
    "LATEST",
    "MANIFEST",
    "CheckpointReader",
    "LoadResult",
    "PendingSave",
    "RankState",
    "capture_rng",
    "cmd_checkpoint_export_hf",
    "cmd_checkpoint_inspect",
    "export_hf",
    "export_megatron_checkpoint",
    "import_megatron_checkpoint",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LR_KEY = "train/lr_scheduler"
_RNG_PREFIX = "rng/"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@attrs.define(kw_only=True)
class RankState:
    """One rank's local tensors and optimizer state (tensors live here, not in records)."""

    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class LoadResult:
    """What a load restored besides the tensors."""

    path: Path
    manifest: CheckpointManifest
    step: int
    data_position: Any
    lr_scheduler: dict[str, Any] | None
    rng_restored: bool


# -- process group -------------------------------------------------------------------


class _Group:
    """The processes taking part (none: this process alone)."""

    def __init__(self, pg: "dist.ProcessGroup | None") -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.pg = pg
        self.rank = dist.get_rank(pg) if self.on else 0
        self.size = dist.get_world_size(pg) if self.on else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, error: str | None) -> None:
        """Raise the first process's error on every process (nobody hangs alone)."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])


def _error(e: BaseException) -> str:
    return str(e) if isinstance(e, SpecError) else f"{type(e).__name__}: {e}"


@contextmanager
def _single_process_dcp(on: bool) -> Iterator[None]:
    """DCP warns when asked (on purpose) to work without a process group: silence that only."""
    if on:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


# -- rng -----------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU, and CUDA when present) RNG states."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{what} cannot be decoded ({type(e).__name__}: {e})") from None


# -- files ---------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path, rel: str, *, sync: bool) -> FileDigest:
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        h = hashlib.file_digest(f, "sha256")
    return FileDigest(path=rel, size=path.stat().st_size, sha256=h.hexdigest())


def _data_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(root: "str | os.PathLike[str]") -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` (``step-*`` directories), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _latest_name(root: Path) -> str | None:
    f = root / LATEST
    if not f.exists():
        return None
    name = f.read_text(errors="replace").strip()
    if not _STEP_DIR.match(name):
        raise CheckpointError(
            f"{f} holds {name!r}, not a checkpoint directory name like 'step-00000012'"
        )
    return name


def resolve_checkpoint(path: "str | os.PathLike[str]") -> Path:
    """A checkpoint directory: ``path`` itself, or what ``path/latest`` names."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    name = _latest_name(p) if p.is_dir() else None
    if name is None:
        raise CheckpointError(
            f"{p} is not a checkpoint: it holds neither {MANIFEST} nor a {LATEST!r} pointer; pass a "
            "checkpoint directory or the root a save wrote into"
        )
    target = p / name
    if not (target / MANIFEST).is_file():
        raise CheckpointError(f"{p / LATEST} names {name}, but {target / MANIFEST} does not exist")
    return target


def read_manifest(path: "str | os.PathLike[str]") -> CheckpointManifest:
    """The manifest of the checkpoint at ``path`` (checked, not the data files)."""
    folder = resolve_checkpoint(path)
    f = folder / MANIFEST
    try:
        text = f.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} cannot be read ({e})") from None
    return CheckpointManifest.from_json(text, source=str(f))


def _verify_files(folder: Path, manifest: CheckpointManifest, share: slice) -> None:
    listed = {f.path for f in manifest.files}
    unlisted = [n for n in _data_files(folder) if n not in listed]
    if unlisted:
        raise CheckpointError(
            f"{folder} holds files the manifest does not list: {unlisted[:5]}; the checkpoint was modified"
        )
    share_files = manifest.files[share]
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(share_files)))) as pool:
        problems = list(pool.map(functools.partial(_check_file, folder), share_files))
    for problem in problems:
        if problem:
            raise CheckpointError(problem)


def _check_file(folder: Path, want: FileDigest) -> str | None:
    p = folder / want.path
    if not p.is_file():
        return f"{p} is listed in the manifest but missing; the checkpoint is incomplete"
    size = p.stat().st_size
    if size != want.size:
        return f"{p} has {size} bytes, the manifest says {want.size}; the file is truncated or corrupted"
    got = _digest(p, want.path, sync=False).sha256
    if got != want.sha256:
        return (
            f"{p} has sha256 {got[:16]}..., the manifest says {want.sha256[:16]}...; the file is "
            "corrupted"
        )
    return None


def verify_checkpoint(path: "str | os.PathLike[str]") -> CheckpointManifest:
    """Check the manifest and every file's size and sha256 (this process alone)."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    _verify_files(folder, manifest, slice(None))
    return manifest


# -- state checks --------------------------------------------------------------------


def _check_states(layout: Layout, states: Mapping[int, RankState], opt: OptimizerSpec) -> None:
    problems: list[str] = []
    for r, st in sorted(states.items()):
        if not 0 <= r < layout.world_size:
            raise CheckpointError(
                f"rank {r} is outside the {layout.kind} layout's {layout.world_size} ranks"
            )
        want = {lt.name: lt for lt in layout.local_tensors(r)}
        have = st.params
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        shapes = [
            f"{n} {tuple(have[n].shape)} != {want[n].shape}"
            for n in want
            if n in have and tuple(have[n].shape) != want[n].shape
        ]
        if missing:
            problems.append(f"rank {r} lacks local tensors {missing[:4]}")
        if extra:
            problems.append(f"rank {r} has tensors the layout does not: {extra[:4]}")
        if shapes:
            problems.append(f"rank {r} mis-shaped {shapes[:4]}")
        if opt.name == "none":
            if st.optim:
                problems.append(
                    f"rank {r} passes optimizer state but optimizer='none'; name the optimizer (e.g. 'adam')"
                )
            continue
        for n, lt in want.items():
            s = st.optim.get(n)
            if s is None:
                problems.append(f"rank {r}: no {opt.name} state for {n}")
                continue
            names = tuple(x.name for x in opt.states)
            if set(s) != set(names):
                problems.append(
                    f"rank {r}: {n} has optimizer states {sorted(s)}, {opt} needs {list(names)}"
                )
                continue
            for x in opt.states:
                shape = tuple(s[x.name].shape)
                if x.kind == "moment" and shape != lt.shape:
                    problems.append(
                        f"rank {r}: {n} {x.name} has shape {shape}, the parameter {lt.shape}"
                    )
                if x.kind == "scalar" and s[x.name].numel() != 1:
                    problems.append(
                        f"rank {r}: {n} {x.name} has shape {shape}, a scalar is expected"
                    )
        extra_opt = [n for n in st.optim if n not in want]
        if extra_opt:
            problems.append(f"rank {r} has optimizer state for unknown tensors {extra_opt[:4]}")
    if problems:
        raise CheckpointError(
            f"local states do not match the {layout.kind} layout: " + "; ".join(problems[:8])
        )


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

    def __init__(self, items: list[ReadItem], dests: list[torch.Tensor], source: str) -> None:
        self._items = items
        self._dests = dests
        self._source = source
        self.blobs: dict[str, bytes] = {}

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
        return self._dests[i]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


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
            raise CheckpointError(f"{what}: the file ends early; it is truncated")
        done += n


class _ChunkReader(FileSystemReader):
    """DCP's file reader, reading each stored chunk once per call (in file order) however
    many requests it serves, straight from its bytes in the file: into the destination
    when one request takes the whole chunk, else into one buffer. (DCP's own reader
    deserialises the chunk again for every request.) ``raw=False`` always goes through
    ``torch.load``: for files we did not write (their tensors may be strided views)."""

    def __init__(self, path: "str | os.PathLike[str]", *, raw: bool = True) -> None:
        super().__init__(path)
        self._raw = raw

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
            return super().read_data(plan, planner)
        groups: dict[MetadataIndex, list[ReadItem]] = {}
        for item in plan.items:
            groups.setdefault(item.storage_index, []).append(item)
        order = sorted(groups, key=lambda k: (infos[k].relative_path, infos[k].offset))
        for rel, keys in itertools.groupby(order, key=lambda k: infos[k].relative_path):
            with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:
                for key in keys:
                    self._serve(stream, rel, key, groups[key], planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _serve(
        self, stream: Any, rel: str, key: MetadataIndex, reqs: list[ReadItem], planner: LoadPlanner
    ) -> None:
        info = self.storage_data[key]
        what = f"{rel} ({key.fqn})"
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
                    _read_exact(stream, raw + first * row, dest, what)  # rows -> destination
                else:
                    buf = torch.empty(part, dtype=dtype)
                    _read_exact(stream, raw + first * row, buf, what)
                    src = buf
                    for d in range(1, len(shape)):
                        src = src.narrow(d, req.storage_offsets[d], req.lengths[d])
                    dest.copy_(src)
                planner.commit_tensor(req, dest)
            return
        if raw is not None and len(reqs) == 1:
            dest = dests[0]
            if tuple(dest.shape) == tuple(shape) and dest.dtype == dtype and dest.is_contiguous():
                _read_exact(stream, raw, dest, what)  # one copy: file -> destination
                planner.commit_tensor(reqs[0], dest)
                return
        if raw is not None:
            stored = torch.empty(shape, dtype=dtype)
            _read_exact(stream, raw, stored, what)
        else:
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
            dest.copy_(src)
            planner.commit_tensor(req, dest)


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


def _piece_view(t: torch.Tensor, local_box: Box, box: Box) -> torch.Tensor:
    return t[local_box.slices()].view(box.shape)


# -- save ----------------------------------------------------------------------------


@attrs.frozen
class _Staged:
    items: list[WriteItem]
    data: dict[MetadataIndex, Callable[[], Any]]
    dtypes: dict[str, tuple[str, tuple[tuple[str, str], ...]]]
    extras: list[str]


def _stage(
    plan: WritePlan,
    states: Mapping[int, RankState],
    opt: OptimizerSpec,
    extras: Mapping[str, bytes],
    *,
    copy: bool,
) -> _Staged:
    shapes = {c.name: c.shape for c in plan.canonical}
    chunks = plan.chunks()
    items: list[WriteItem] = []
    data: dict[MetadataIndex, Callable[[], Any]] = {}
    dtypes: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}

    def add(key: str, box: Box, shape: tuple[int, ...], src: torch.Tensor) -> None:
        item = _write_item(key, box, shape, src.dtype)
        items.append(item)
        if copy:  # off the training path: later updates of src do not reach the checkpoint
            owned = src.detach().to("cpu", copy=True).contiguous()
            data[item.index] = functools.partial(_identity, owned)
        else:
            data[item.index] = functools.partial(_owned, src)

    for r, st in sorted(states.items()):
        for p in plan.for_rank(r):
            src = st.params[p.tensor]
            add(p.canonical, p.box, shapes[p.canonical], _piece_view(src, p.local_box, p.box))
            sdt = []
            for m in opt.moments:
                t = st.optim[p.tensor][m]
                add(
                    optim_key(p.canonical, m),
                    p.box,
                    shapes[p.canonical],
                    _piece_view(t, p.local_box, p.box),
                )
                sdt.append((m, dtype_name(t.dtype)))
            for s in opt.scalars:
                t = st.optim[p.tensor][s]
                sdt.append((s, dtype_name(t.dtype)))
                if chunks[p.canonical][0] == (p.box, r):  # the first chunk's writer saves scalars
                    add(optim_key(p.canonical, s), Box(ranges=()), (), t.reshape(()))
            got = (dtype_name(src.dtype), tuple(sorted(sdt)))
            seen = dtypes.setdefault(p.canonical, got)
            if seen != got:
                raise CheckpointError(
                    f"{p.canonical}: rank {r} holds it as {got}, another piece as {seen}; every piece of a "
                    "tensor (and of each optimizer state) must have one dtype"
                )
    for key, blob in extras.items():
        item = WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
        items.append(item)
        data[item.index] = functools.partial(io.BytesIO, blob)
    return _Staged(items=items, data=data, dtypes=dtypes, extras=list(extras))


def _commit(tmp: Path, final: Path, root: Path, manifest: CheckpointManifest, keep: int) -> None:
    _write_text_atomic(tmp / MANIFEST, manifest.to_json())
    _fsync_dir(tmp)
    trash = root / f".trash-{final.name}"
    if final.exists():  # an orphan of an interrupted commit (never the latest: checked before)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)
    for _, old in list_checkpoints(root)[:-keep]:
        if old.name == final.name:
            continue
        gone = root / f".trash-{old.name}"
        os.replace(old, gone)  # atomic: a half-deleted checkpoint never looks like one
        shutil.rmtree(gone, ignore_errors=True)


def _prepare_root(root: Path, name: str, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if _latest_name(root) == name:
        raise CheckpointError(
            f"{root / name} is the latest checkpoint already; save under a new step, or load it instead"
        )
    for p in root.iterdir():  # leftovers of interrupted saves and deletions
        if p.name.startswith((".tmp-", ".trash-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    tmp.mkdir()


@attrs.define
class PendingSave:
    """An asynchronous save: state was copied; writing and commit run in the background."""

    path: Path
    _thread: threading.Thread
    _error: list[BaseException]

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until committed; raise what the save raised."""
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self.path


def save_checkpoint(
    root: "str | os.PathLike[str]",
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    model: ModelSpec,
    allocation: str,
    step: int,
    optimizer: "str | OptimizerSpec" = "none",
    data_position: Any = None,
    lr_scheduler: Mapping[str, Any] | None = None,
    save_rng: bool = True,
    keep: int = 3,
    dedup: Dedup = "balanced",
    process_group: "dist.ProcessGroup | None" = None,
    blocking: bool = True,
    thread_count: int = 1,
) -> "Path | PendingSave":
    """Save ``states`` (this process's ranks of ``layout``) as checkpoint ``root/step-<step>``.

    Collective over ``process_group`` (default: the world when initialised). Each
    layout rank must be passed by exactly one process. ``lr_scheduler`` and
    ``data_position`` (JSON-able) are taken from the first process; RNG states from
    every process that passes a single rank, as they were when the call began (the
    call leaves them as it found them). With ``blocking=False`` the state is copied
    first and a :class:`PendingSave` returned: call its ``wait()`` before the next
    save (distributed, the background write uses a gloo group of its own, made once).
    """
    entry_rng = capture_rng() if save_rng and len(states) == 1 else None
    python_rng = random.getstate()
    try:
        return _save(
            Path(root),
            layout=layout,
            states=states,
            model=model,
            allocation=allocation,
            step=step,
            opt=optimizer_spec(optimizer) if isinstance(optimizer, str) else optimizer,
            data_position=data_position,
            lr_scheduler=lr_scheduler,
            rng=entry_rng,
            keep=keep,
            dedup=dedup,
            process_group=process_group,
            blocking=blocking,
            thread_count=thread_count,
        )
    finally:
        random.setstate(python_rng)  # type checks sample with python's RNG: undo that


def _save(
    root: Path,
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    model: ModelSpec,
    allocation: str,
    step: int,
    opt: OptimizerSpec,
    data_position: Any,
    lr_scheduler: Mapping[str, Any] | None,
    rng: dict[str, Any] | None,
    keep: int,
    dedup: Dedup,
    process_group: "dist.ProcessGroup | None",
    blocking: bool,
    thread_count: int,
) -> "Path | PendingSave":
    g = _Group(process_group)
    name = step_dir_name(step)
    final = root / name
    running = _PENDING.get(root.resolve())
    tmp = root / f".tmp-{name}"
    error: str | None = None
    plan: WritePlan | None = None
    extras: dict[str, bytes] = {}
    try:
        if running is not None and not running.done():
            raise CheckpointError(
                f"a background save into {running.path} is still running; call its wait() first"
            )
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be >= 1 (the checkpoint being saved is kept)")
        if step < 0:
            raise CheckpointError(f"step={step} must be >= 0")
        plan = plan_save(layout, dedup=dedup)
        _check_states(layout, states, opt)
        json.dumps(data_position)
        if g.rank == 0 and lr_scheduler is not None:
            extras[_LR_KEY] = _to_bytes(dict(lr_scheduler))
        if rng is not None:
            extras[f"{_RNG_PREFIX}{next(iter(states))}"] = _to_bytes(rng)
    except (SpecError, TypeError, ValueError) as e:
        error = f"cannot save checkpoint {final}: {_error(e)}"
    g.agree(error)
    assert plan is not None
    held = [r for rs in g.all_gather(sorted(states)) for r in rs]
    if sorted(held) != list(range(layout.world_size)):
        dup = sorted({r for r in held if held.count(r) > 1})
        miss = sorted(set(range(layout.world_size)) - set(held))
        raise CheckpointError(
            f"cannot save {final}: every rank of the {layout.kind} layout must be passed by exactly "
            f"one process; missing {miss}, passed twice {dup}"
        )
    staged: _Staged | None = None
    try:
        staged = _stage(plan, states, opt, extras, copy=not blocking)
    except SpecError as e:
        error = str(e)
    g.agree(error)
    assert staged is not None
    gathered = g.all_gather((staged.dtypes, staged.extras))
    manifest: CheckpointManifest | None = None
    if g.rank == 0:
        try:
            dtypes: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
            for d, _ in gathered:
                for k, v in d.items():
                    if dtypes.setdefault(k, v) != v:
                        raise CheckpointError(
                            f"{k} is held as {v} and as {dtypes[k]} on different ranks; every piece "
                            "of a tensor (and of each optimizer state) must have one dtype"
                        )
            manifest = make_manifest(
                plan,
                allocation=allocation,
                model_config=model.hf_config(),
                step=step,
                optimizer=opt,
                dtypes={k: v[0] for k, v in dtypes.items()},
                state_dtypes={k: dict(v[1]) for k, v in dtypes.items()},
                data_position=data_position,
                extras=sorted(x for _, xs in gathered for x in xs),
                library_version=_library_version(),
            )
            _prepare_root(root, name, tmp)
        except (SpecError, OSError) as e:
            error = f"cannot save checkpoint {final}: {_error(e)}"
    g.agree(error)
    pg = _async_group(process_group) if not blocking and g.on else process_group

    def write() -> Path:
        # No type-checked (beartype) calls here: they draw from python's RNG, which the
        # training thread owns while a save runs in the background.
        gw = _Group(pg) if g.on else g
        with _single_process_dcp(g.on):
            dcp.save(
                {},
                storage_writer=FileSystemWriter(
                    tmp, single_file_per_rank=True, sync_files=True, thread_count=thread_count
                ),
                planner=_SavePlanner(staged.items, staged.data),
                process_group=pg,
                no_dist=not g.on,
            )
        err: str | None = None
        digests: list[FileDigest] = []
        try:
            files = _data_files(tmp)
            mine = files[gw.rank :: gw.size]
            with ThreadPoolExecutor(max_workers=max(1, min(4, len(mine)))) as pool:
                digests = list(pool.map(lambda f: _digest(tmp / f, f, sync=True), mine))
        except OSError as e:
            err = f"cannot save checkpoint {final}: {e}"
        everyone = gw.all_gather((err, digests))
        err = next((e for e, _ in everyone if e), None)
        if gw.rank == 0 and err is None:
            assert manifest is not None
            try:
                listed = sorted((d for _, ds in everyone for d in ds), key=lambda d: d.path)
                _commit(tmp, final, root, attrs.evolve(manifest, files=tuple(listed)), keep)
            except (SpecError, OSError) as e:
                err = f"cannot commit checkpoint {final}: {_error(e)}"
        gw.agree(err if gw.rank == 0 else None)
        return final

    if blocking:
        return write()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            write()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name=f"checkpoint-{name}", daemon=True)
    thread.start()
    pending = PendingSave(final, thread, errors)
    _PENDING[root.resolve()] = pending
    return pending


#: the latest background save per checkpoint root, in this process.
_PENDING: dict[Path, PendingSave] = {}


_ASYNC_GROUPS: dict[object, "dist.ProcessGroup"] = {}


def _async_group(pg: "dist.ProcessGroup | None") -> "dist.ProcessGroup":
    """A gloo group over the same ranks, for background saves (made once, collectively)."""
    key = pg if pg is not None else "world"
    if key not in _ASYNC_GROUPS:
        ranks = dist.get_process_group_ranks(pg) if pg is not None else None
        _ASYNC_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _ASYNC_GROUPS[key]


def _library_version() -> str:
    from .. import __version__

    return __version__


# -- load ----------------------------------------------------------------------------


def _read_items(
    plan: PieceLoadPlan,
    st: RankState,
    opt: OptimizerSpec,
    items: list[ReadItem],
    dests: list[torch.Tensor],
    scalars: dict[tuple[str, str, str], torch.Tensor],
) -> None:
    def add(key: str, box: Box, chunk: Box, dest: torch.Tensor) -> None:
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, box.start, index=len(dests)),
                dest_offsets=torch.Size([0] * box.ndim),
                storage_index=MetadataIndex(key, chunk.start),
                storage_offsets=torch.Size(
                    b - c for b, c in zip(box.start, chunk.start, strict=True)
                ),
                lengths=torch.Size(box.shape),
            )
        )
        dests.append(dest)

    for rp in plan.reads:
        add(rp.canonical, rp.box, rp.chunk, _piece_view(st.params[rp.tensor], rp.local_box, rp.box))
        for m in opt.moments:
            view = _piece_view(st.optim[rp.tensor][m], rp.local_box, rp.box)
            add(optim_key(rp.canonical, m), rp.box, rp.chunk, view)
        for s in opt.scalars:
            k = (rp.tensor, rp.canonical, s)
            if k not in scalars:
                scalars[k] = torch.empty((), dtype=st.optim[rp.tensor][s].dtype)
                add(optim_key(rp.canonical, s), Box(ranges=()), Box(ranges=()), scalars[k])


def load_checkpoint(
    path: "str | os.PathLike[str]",
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    optimizer: "str | OptimizerSpec" = "none",
    restore_rng_state: bool = True,
    verify: bool = True,
    allow_cast: bool = False,
    process_group: "dist.ProcessGroup | None" = None,
) -> LoadResult:
    """Load a checkpoint into ``states`` (local tensors of ``layout``), in place.

    ``path`` is a checkpoint directory or a root with ``latest``. The manifest and (with
    ``verify``) every file's sha256 are checked first, the files shared among the
    processes of ``process_group``; any defect raises ``CheckpointError`` on every
    process, before any tensor is touched. ``optimizer='none'`` loads parameters only.
    Dtypes must match the stored ones unless ``allow_cast``. Padding is zeroed.
    """
    g = _Group(process_group)
    opt = optimizer_spec(optimizer) if isinstance(optimizer, str) else optimizer
    error: str | None = None
    folder = Path(path)
    plans: dict[int, PieceLoadPlan] = {}
    manifest: CheckpointManifest | None = None
    try:
        folder = resolve_checkpoint(path)
        manifest = read_manifest(folder)
        source = str(folder)
        check_model(manifest, layout.canonical, source=source)
        check_optimizer(manifest, opt, source=source)
        _check_states(layout, states, opt)
        if verify:
            _verify_files(folder, manifest, slice(g.rank, None, g.size))
        if not allow_cast:
            _check_dtypes(manifest, layout, states, opt)
        plans = {r: plan_load(manifest, layout, r) for r in states}
    except (SpecError, OSError) as e:
        error = f"cannot load checkpoint {folder}: {_error(e)}"
    g.agree(error)
    assert manifest is not None
    items: list[ReadItem] = []
    dests: list[torch.Tensor] = []
    scalars: dict[int, dict[tuple[str, str, str], torch.Tensor]] = {}
    for r, plan in plans.items():
        scalars[r] = {}
        _read_items(plan, states[r], opt, items, dests, scalars[r])
    # RNG states are per process: restored when each process loads one rank of a world
    # as large as the one that saved.
    own = (
        next(iter(states))
        if len(states) == 1 and manifest.world_size == layout.world_size
        else None
    )
    blobs = [
        k
        for k in manifest.extras
        if k == _LR_KEY or (restore_rng_state and k == f"{_RNG_PREFIX}{own}")
    ]
    for k in blobs:
        items.append(
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(k),
                dest_offsets=torch.Size([0]),
                storage_index=MetadataIndex(k),
                storage_offsets=torch.Size([0]),
                lengths=torch.Size([0]),
            )
        )
    planner = _LoadPlanner(items, dests, str(folder))
    with torch.no_grad():
        try:
            with _single_process_dcp(False):
                dcp.load({}, storage_reader=_ChunkReader(folder), planner=planner, no_dist=True)
        except Exception as e:
            raise CheckpointError(f"cannot load checkpoint {folder}: {_error(e)}") from e
        for r, plan in plans.items():
            st = states[r]
            for pad in plan.padding:
                st.params[pad.tensor][pad.local_box.slices()].zero_()
                for m in opt.moments:
                    st.optim[pad.tensor][m][pad.local_box.slices()].zero_()
            _set_scalars(st, opt, scalars[r], str(folder))
    lr = (
        _from_bytes(planner.blobs[_LR_KEY], f"{folder}: {_LR_KEY}")
        if _LR_KEY in planner.blobs
        else None
    )
    rng_key = f"{_RNG_PREFIX}{own}"
    restored = False
    if rng_key in planner.blobs:
        restore_rng(_from_bytes(planner.blobs[rng_key], f"{folder}: {rng_key}"))
        restored = True
    return LoadResult(
        path=folder,
        manifest=manifest,
        step=manifest.step,
        data_position=json.loads(manifest.data_position),
        lr_scheduler=lr,
        rng_restored=restored,
    )


def _check_dtypes(
    manifest: CheckpointManifest,
    layout: Layout,
    states: Mapping[int, RankState],
    opt: OptimizerSpec,
) -> None:
    saved = {t.name: t for t in manifest.tensors}
    for r, st in sorted(states.items()):
        for lt in layout.local_tensors(r):
            names = {p.canonical for p in lt.pieces if p.canonical is not None}
            for c in sorted(names):
                t = saved[c]
                pairs = [("parameter", t.dtype, st.params[lt.name].dtype)]
                sd = dict(t.state_dtypes)
                pairs += [(s.name, sd[s.name], st.optim[lt.name][s.name].dtype) for s in opt.states]
                for what, want, have in pairs:
                    if torch_dtype(want) != have:
                        raise CheckpointError(
                            f"{c} {what} is stored as {want}, rank {r}'s {lt.name} is {dtype_name(have)}; "
                            "pass allow_cast=True to cast explicitly"
                        )


def _set_scalars(
    st: RankState,
    opt: OptimizerSpec,
    read: Mapping[tuple[str, str, str], torch.Tensor],
    source: str,
) -> None:
    by_tensor: dict[tuple[str, str], list[tuple[str, torch.Tensor]]] = {}
    for (tensor, canonical, s), v in read.items():
        by_tensor.setdefault((tensor, s), []).append((canonical, v))
    for (tensor, s), values in by_tensor.items():
        first_c, first = values[0]
        for c, v in values[1:]:
            if not torch.equal(v, first):
                raise CheckpointError(
                    f"{source}: {tensor} fuses {first_c} ({s}={first.item()}) and {c} ({s}={v.item()}); "
                    "a fused local tensor needs one value"
                )
        dest = st.optim[tensor][s]
        dest.copy_(first.reshape(dest.shape))


# -- reading canonical tensors -------------------------------------------------------


def _read_box(
    storage: "_ChunkReader",
    key: str,
    chunks: tuple[Box, ...],
    box: Box,
    dtype: torch.dtype,
    source: str,
) -> torch.Tensor:
    """``box`` of the stored tensor ``key`` (stored as ``chunks``), read through ``storage``."""
    out = torch.empty(box.shape, dtype=dtype)
    items: list[ReadItem] = []
    dests: list[torch.Tensor] = []
    for chunk in chunks:
        inter = chunk.intersect(box)
        if inter is None:
            continue
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, inter.start, index=len(dests)),
                dest_offsets=torch.Size([0] * box.ndim),
                storage_index=MetadataIndex(key, chunk.start),
                storage_offsets=torch.Size(
                    a - b for a, b in zip(inter.start, chunk.start, strict=True)
                ),
                lengths=torch.Size(inter.shape),
            )
        )
        dests.append(out[inter.relative_to(box).slices()])
    storage.read_data(LoadPlan(items), _LoadPlanner(items, dests, source)).wait()
    return out


class CheckpointReader:
    """Canonical tensors of a checkpoint, read box by box (a ``convert.Reader``).

    ``read(name, box)`` returns ``box`` of a parameter; ``read_state(name, state, box)``
    of an optimizer state. Only the chunks a box touches are read.
    """

    def __init__(self, path: "str | os.PathLike[str]", *, verify: bool = True) -> None:
        self.path = resolve_checkpoint(path)
        self.manifest = verify_checkpoint(self.path) if verify else read_manifest(self.path)
        self._storage = _ChunkReader(self.path)
        self._storage.set_up_storage_reader(self._storage.read_metadata(), True)
        self._saved = {t.name: t for t in self.manifest.tensors}

    def _saved_tensor(self, name: str) -> SavedTensor:
        saved = self._saved.get(name)
        if saved is None:
            raise CheckpointError(f"the checkpoint {self.path} holds no tensor {name!r}")
        return saved

    def _read(self, key: str, chunks: tuple[Box, ...], box: Box, dtype: str) -> torch.Tensor:
        return _read_box(self._storage, key, chunks, box, torch_dtype(dtype), str(self.path))

    def _box(self, saved: SavedTensor, box: "Box | None") -> Box:
        full = Box.full(saved.shape)
        if box is None:
            return full
        if box.ndim != full.ndim or not full.contains(box):
            raise CheckpointError(
                f"box {box} does not lie inside {saved.name!r} of shape {saved.shape}"
            )
        return box

    def read(self, name: str, box: "Box | None" = None) -> torch.Tensor:
        """``box`` (default: all) of parameter ``name``, in its stored dtype."""
        saved = self._saved_tensor(name)
        chunks = tuple(c.box for c in saved.chunks)
        return self._read(name, chunks, self._box(saved, box), saved.dtype)

    def __call__(self, name: str, box: Box) -> torch.Tensor:
        return self.read(name, box)

    def read_state(self, name: str, state: str, box: "Box | None" = None) -> torch.Tensor:
        """``box`` of optimizer state ``state`` of ``name`` (a scalar state ignores ``box``)."""
        saved = self._saved_tensor(name)
        kinds = {s.name: s.kind for s in self.manifest.optimizer.states}
        if state not in kinds:
            raise CheckpointError(
                f"the checkpoint's optimizer {self.manifest.optimizer} has no state {state!r}"
            )
        dtype = dict(saved.state_dtypes)[state]
        if kinds[state] == "scalar":
            scalar = Box(ranges=())
            return self._read(optim_key(name, state), (scalar,), scalar, dtype)
        chunks = tuple(c.box for c in saved.chunks)
        return self._read(optim_key(name, state), chunks, self._box(saved, box), dtype)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def export_hf(
    path: "str | os.PathLike[str]",
    dest: "str | os.PathLike[str]",
    *,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
) -> Path:
    """Write a checkpoint's parameters as a Hugging Face safetensors checkpoint (+ config.json)."""
    from ..model import model_from_hf_config
    from .hf_io import write_hf_checkpoint

    reader = CheckpointReader(path)
    model = model_from_hf_config(reader.manifest.model)
    check_model(reader.manifest, model.tensors, source=str(reader.path))
    return write_hf_checkpoint(
        dest,
        ((t.name, reader.read(t.name)) for t in reader.manifest.tensors),
        config=reader.manifest.model,
        model=model,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


# -- Megatron-Core dist_checkpointing interop -------------------------------------------

#: ``metadata.json`` of a Megatron-Core ``torch_dist`` checkpoint.
MCORE_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MCORE_EXTRA_STATE = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def _mcore_layout(model: ModelSpec) -> Layout:
    """Megatron-Core's checkpoint view of ``model``: TP- and PP-unsharded, TE key names,
    vocabulary unpadded (the stored rows beyond it are padding)."""
    from ..allocation import ParallelDims
    from ..megatron_layout import megatron_layout

    if model.is_moe:
        raise CheckpointError(
            f"{model.model_type}: Megatron-Core checkpoints of MoE models (experts stored per "
            "expert) are not supported; only dense models are"
        )
    return megatron_layout(model, ParallelDims(), naming="te", vocab_divisible_by=1)


def _mcore_key(name: str) -> tuple[str, int | None]:
    m = _MCORE_LAYER.match(name)
    return (f"decoder.layers.{m.group(2)}", int(m.group(1))) if m else (name, None)


def import_megatron_checkpoint(
    path: "str | os.PathLike[str]", model: ModelSpec
) -> dict[str, torch.Tensor]:
    """Canonical parameters of a Megatron-Core ``dist_checkpointing`` (``torch_dist``)
    checkpoint of ``model`` (a ``GPTModel`` under any TP/PP), bitwise.

    Layers are stacked along a leading dim (global layer index); rows of the embedding
    and output layer beyond ``vocab_size`` are padding and are not imported.
    """
    folder = Path(path)
    try:
        backend = json.loads((folder / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{folder} is not a Megatron-Core dist checkpoint: metadata.json cannot be read ({e})"
        ) from None
    if backend.get("sharded_backend") != "torch_dist":
        raise CheckpointError(
            f"{folder}: sharded_backend {backend.get('sharded_backend')!r} is not supported; save "
            "with Megatron-Core's torch_dist backend"
        )
    from ..convert import to_hf

    layout = _mcore_layout(model)
    storage = _ChunkReader(folder, raw=False)
    metadata = storage.read_metadata()
    storage.set_up_storage_reader(metadata, True)
    stored = metadata.state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    for lt in layout.local_tensors(0):
        key, layer = _mcore_key(lt.name)
        md = stored.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"{folder}: the Megatron checkpoint has no tensor {key!r} (for {lt.name}); it was "
                f"not saved from a GPTModel of this {model.model_type} model"
            )
        size = tuple(md.size)
        if layer is not None:
            want = (model.num_layers, *lt.shape)
            ok = size == want
            box = Box(ranges=((layer, layer + 1), *((0, d) for d in lt.shape)))
        else:
            want = lt.shape
            ok = size[1:] == lt.shape[1:] and len(size) == len(lt.shape) and size[0] >= lt.shape[0]
            box = Box.full(lt.shape)
        if not ok:
            raise CheckpointError(
                f"{folder}: {key} has shape {size}, {model.model_type} with hidden_size="
                f"{model.hidden_size}, {model.num_layers} layers needs {want}"
                + (" (rows >= vocab_size)" if layer is None else "")
            )
        chunks = tuple(
            Box(ranges=tuple((o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True)))
            for c in md.chunks
        )
        t = _read_box(storage, key, chunks, box, md.properties.dtype, str(folder))
        state[lt.name] = t.reshape(lt.shape)
    return to_hf({0: state}, layout)


def export_megatron_checkpoint(
    source: "Mapping[str, torch.Tensor] | Callable[[str, Box], torch.Tensor]",
    model: ModelSpec,
    dest: "str | os.PathLike[str]",
    *,
    vocab_size_padded: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write canonical parameters (a mapping, a ``CheckpointReader``, any reader) as a
    Megatron-Core ``torch_dist`` checkpoint that ``dist_checkpointing.load`` reads into a
    ``GPTModel`` of ``model`` under any TP/PP; written atomically (temporary directory,
    fsync, rename). ``vocab_size_padded`` is the embedding rows of the target
    ``GPTModel`` (its padded vocabulary; default ``vocab_size``), padding rows zero.
    """
    from ..convert import to_megatron

    out = Path(dest)
    if out.exists() and not overwrite:
        raise CheckpointError(
            f"{out} already exists; pass overwrite=True or choose another directory"
        )
    rows = vocab_size_padded if vocab_size_padded is not None else model.vocab_size
    if rows < model.vocab_size:
        raise CheckpointError(
            f"vocab_size_padded={rows} is smaller than vocab_size={model.vocab_size}"
        )
    layout = _mcore_layout(model)
    local = to_megatron(source, layout, 0)
    stacked: dict[str, list[torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        key, layer = _mcore_key(name)
        if layer is None:
            if rows > t.shape[0] and name in (
                "embedding.word_embeddings.weight",
                "output_layer.weight",
            ):
                t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
            tensors[key] = t
        else:
            stacked.setdefault(key, []).append(t)
    for key, layers in stacked.items():
        tensors[key] = torch.stack(layers)
    extras = {
        f"decoder.layers.{module}._extra_state/shard_{layer}_{model.num_layers}": _to_bytes([None])
        for module in _MCORE_EXTRA_STATE
        for layer in range(model.num_layers)
    }
    items: list[WriteItem] = []
    data: dict[MetadataIndex, Callable[[], Any]] = {}
    for key, t in tensors.items():
        item = _write_item(key, Box.full(tuple(t.shape)), tuple(t.shape), t.dtype)
        items.append(item)
        data[item.index] = functools.partial(_owned, t)
    for key, blob in extras.items():
        item = WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
        items.append(item)
        data[item.index] = functools.partial(io.BytesIO, blob)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with _single_process_dcp(False):
            dcp.save(
                {},
                storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                planner=_SavePlanner(items, data),
                no_dist=True,
            )
        torch.save({}, tmp / "common.pt")
        _write_text_atomic(tmp / "metadata.json", json.dumps(MCORE_METADATA))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -- inspect -------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def inspect_checkpoint(
    path: "str | os.PathLike[str]", *, verify: bool = False, max_tensors: int = 24
) -> str:
    """A readable summary: manifest, strategy, tensors, sizes, files (and checksums with ``verify``)."""
    p = Path(path)
    folder = resolve_checkpoint(p)
    m = verify_checkpoint(folder) if verify else read_manifest(folder)
    cfg = m.model
    lines = [f"checkpoint {folder}"]
    root = folder.parent if folder != p else p
    others = list_checkpoints(root)
    if others:
        latest = _latest_name(root)
        lines.append(
            f"  in {root}: "
            + ", ".join(f"{d.name}{' (latest)' if d.name == latest else ''}" for _, d in others)
        )
    params = sum(t.numel for t in m.tensors)
    lines += [
        f"  step {m.step}, data position {m.data_position}",
        f"  saved with allocation {m.allocation} ({m.layout_kind} layout, {m.world_size} ranks), "
        f"areal_fn {m.library_version}",
        f"  model {cfg.get('model_type')}: {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
        f"vocab {cfg.get('vocab_size')}, {params:,} parameters in {len(m.tensors)} canonical tensors",
        f"  optimizer {m.optimizer}",
        f"  extras {list(m.extras)}",
        f"  files {len(m.files)}, {_human(m.nbytes)}"
        + (" (every sha256 verified)" if verify else " (checksums not verified; pass verify)"),
    ]
    per_rank: dict[int, int] = {}
    for t in m.tensors:
        for c in t.chunks:
            per_rank[c.rank] = per_rank.get(c.rank, 0) + c.box.numel * (t.nbytes // max(1, t.numel))
    lines.append(
        "  bytes written per rank: "
        + ", ".join(f"{r}: {_human(b)}" for r, b in sorted(per_rank.items()))
    )
    lines.append(f"  {'tensor':<52} {'shape':<16} {'dtype':<9} {'chunks':>6} {'bytes':>10}")
    for t in m.tensors[:max_tensors]:
        lines.append(
            f"  {t.name:<52} {'x'.join(map(str, t.shape)):<16} {t.dtype:<9} {len(t.chunks):>6} {_human(t.nbytes):>10}"
        )
    if len(m.tensors) > max_tensors:
        lines.append(f"  ... {len(m.tensors) - max_tensors} more tensors")
    lines.append("  files: " + ", ".join(f"{f.path} ({_human(f.size)})" for f in m.files[:12]))
    return "\n".join(lines)


def cmd_checkpoint_inspect(args: Any) -> int:
    """``areal-fn checkpoint inspect DIR [--verify] [--tensors N]``."""
    print(
        inspect_checkpoint(
            args.dir,
            verify=bool(getattr(args, "verify", False)),
            max_tensors=int(getattr(args, "tensors", 24)),
        )
    )
    return 0


def cmd_checkpoint_export_hf(args: Any) -> int:
    """``areal-fn checkpoint export-hf DIR DEST [--overwrite]``."""
    out = export_hf(args.dir, args.dest, overwrite=bool(getattr(args, "overwrite", False)))
    print(f"wrote {out}")
    return 0
