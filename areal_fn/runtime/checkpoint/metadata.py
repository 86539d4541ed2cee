"""torch DCP metadata without unpickling: built from the manifest; ``.metadata`` only checked.

torch DCP describes a checkpoint in ``.metadata``, a Python pickle, and torch's
``FileSystemReader.read_metadata`` reads it with ``pickle.load``: unpickling runs any
code the file holds, and a checksum in the manifest does not say who wrote the file.
So our reads never unpickle it:

- :func:`metadata_from_manifest` builds DCP's ``Metadata`` (tensor and chunk
  properties, where each entry lies) from the JSON manifest; :func:`stored_items` is
  the other direction, what a save records from what DCP reports it wrote.
- :func:`check_metadata_file` still refuses a ``.metadata`` that is not what torch
  writes (we keep writing it, so that torch's own ``dcp.load`` reads our checkpoints):
  it walks the pickle's opcodes (``pickletools``, which runs nothing) and refuses any
  import outside the classes DCP metadata is made of.
- :func:`dcp_metadata` is what every read of our checkpoints calls; only for a
  checkpoint whose manifest predates ``storage``, and only with ``trust_pickle=True``,
  does it unpickle ``.metadata`` (:func:`unpickle_metadata`, the one place that does;
  Megatron-Core's checkpoints, which have nothing else, need the same opt-in).
"""

import pickletools
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from areal_fn.errors import CheckpointError
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.checkpoint.manifest import CheckpointManifest, SavedTensor, optim_key
from areal_fn.plans.checkpoint.storage import StoredItem

#: DCP's metadata file in a checkpoint directory
METADATA = ".metadata"
#: how to ask for the opt-in: the argument, and the CLI flag where there is one
TRUST_FLAG = "trust_pickle=True (--trust-pickle on the command line)"


def trust_pickle_rule(flag: str = TRUST_FLAG) -> str:
    """What ``trust_pickle`` means, said wherever it is asked for."""
    return (
        f"unpickling a file runs any code it holds, so pass {flag} only for a checkpoint "
        "you saved yourself or got from a source you trust"
    )


_REMEDY = "restore it from a copy or use another checkpoint"

_MD = "torch.distributed.checkpoint.metadata"
#: every import a pickle of DCP metadata makes (module, name); anything else is refused
ALLOWED_GLOBALS = frozenset(
    {
        *(
            (_MD, n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "ChunkStorageMetadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        *((m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "WindowsPath")),
        *(("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)),
    }
)
_STRINGS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING"}
)
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
#: opcodes that reach objects by a registry or a callback rather than an import
_REFUSED_OPS = frozenset({"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


# -- the manifest <-> DCP metadata -----------------------------------------------------


def _tensor_md(t: SavedTensor, dtype: str, *, scalar: bool) -> TensorStorageMetadata:
    props = TensorProperties(dtype=torch_dtype(dtype))
    if scalar:
        empty = torch.Size(())
        return TensorStorageMetadata(props, empty, [ChunkStorageMetadata(empty, empty)])
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(c.box.start), sizes=torch.Size(c.box.shape))
        for c in t.chunks
    ]
    return TensorStorageMetadata(props, torch.Size(t.shape), chunks)


def metadata_from_manifest(manifest: CheckpointManifest) -> Metadata:
    """DCP's ``Metadata`` of a checkpoint, from its manifest alone (``storage`` non-empty)."""
    kinds = {s.name: s.kind for s in manifest.optimizer.states}
    entries: dict[str, Any] = {}
    for t in manifest.tensors:
        entries[t.name] = _tensor_md(t, t.dtype, scalar=False)
        for state, dtype in t.state_dtypes:
            entries[optim_key(t.name, state)] = _tensor_md(
                t, dtype, scalar=kinds[state] == "scalar"
            )
    extras = set(manifest.extras)
    entries.update({x: BytesStorageMetadata() for x in manifest.extras})
    storage = {
        MetadataIndex(s.key, None if s.key in extras else s.offsets): _StorageInfo(
            s.file, s.offset, s.length
        )
        for s in manifest.storage
    }
    return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta())


def stored_items(metadata: "Metadata | None") -> tuple[StoredItem, ...]:
    """Where DCP wrote each entry, from the ``Metadata`` its ``save`` returned (file order)."""
    data = getattr(metadata, "storage_data", None)
    if not isinstance(data, dict) or not data:
        raise CheckpointError(
            "torch DCP did not report where it wrote the entries (Metadata.storage_data); "
            f"this torch version ({torch.__version__}) is not supported"
        )
    out = []
    for index, info in data.items():
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"torch DCP wrote {index.fqn} through transforms {info.transform_descriptors}; "
                "only plain torch.save entries are supported"
            )
        out.append(
            StoredItem(
                key=index.fqn,
                offsets=() if index.offset is None else tuple(index.offset),
                file=str(info.relative_path),
                offset=int(info.offset),
                length=int(info.length),
            )
        )
    return tuple(sorted(out, key=lambda s: (s.file, s.offset, s.key)))


# -- .metadata: checked, never unpickled unless trusted ----------------------------------


class _NotMetadata(Exception):
    """What a pickle does that DCP metadata never does."""


def pickle_imports(data: bytes) -> list[tuple[str, str]]:
    """Every (module, name) the pickle ``data`` imports, found by reading its opcodes
    (nothing is unpickled). ``_NotMetadata`` for what cannot be told statically: an
    import whose name is computed, a registry or callback opcode, bytes after the end."""
    memo: dict[int, str | None] = {}
    pushed: list[str | None] = []  # per value pushed: the string, or None (not a literal string)
    found: list[tuple[str, str]] = []
    end = -1
    for op, arg, pos in pickletools.genops(data):
        name = op.name
        if name in _REFUSED_OPS:
            raise _NotMetadata(f"uses the pickle opcode {name}")
        if name == "MEMOIZE" or name in _PUTS:
            memo[len(memo) if name == "MEMOIZE" else int(arg or 0)] = pushed[-1] if pushed else None
        elif name in _GETS:
            pushed.append(memo.get(int(arg or 0)))
        elif name in _STRINGS:
            pushed.append(str(arg))
        elif name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.append((module, attr))
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            module_, attr_ = (pushed[-2], pushed[-1]) if len(pushed) > 1 else (None, None)
            if module_ is None or attr_ is None:
                raise _NotMetadata("imports a name it computes while unpickling")
            found.append((module_, attr_))
            pushed.append(None)
        elif name == "STOP":
            end = int(pos or 0) + 1
        elif name != "FRAME":
            pushed.append(None)
    if end != len(data):
        raise _NotMetadata(f"holds {len(data) - end} bytes after the end of its pickle")
    return found


def check_metadata_file(path: Path) -> None:
    """``CheckpointError`` naming ``path`` unless it is a pickle of DCP metadata alone:
    every import one of :data:`ALLOWED_GLOBALS`. Reads the opcodes, runs nothing."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing; the checkpoint is incomplete: {_REMEDY}"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    refused = (
        "; a file like this runs code when unpickled (torch's dcp.load does), so the "
        "checkpoint is refused and nothing of it was unpickled: do not open it with torch "
        "either, and get the checkpoint again from a source you trust"
    )
    try:
        imports = pickle_imports(data)
    except _NotMetadata as e:
        raise CheckpointError(f"{path} is not torch DCP metadata: it {e}{refused}") from None
    except Exception as e:  # pickletools: unknown opcode, truncated argument, ...
        raise CheckpointError(
            f"{path} cannot be read as torch DCP metadata (not a pickle: {type(e).__name__}: "
            f"{e}); the file is corrupted: {_REMEDY}"
        ) from None
    bad = [f"{m}.{n}" for m, n in imports if (m, n) not in ALLOWED_GLOBALS]
    if bad:
        raise CheckpointError(
            f"{path} is not torch DCP metadata: unpickling it would import {bad[0]}, which DCP "
            f"metadata never holds{refused}"
        )


def unpickle_metadata(folder: Path) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, unpickled: only on the caller's ``trust_pickle``."""
    try:
        md = FileSystemReader(folder).read_metadata()
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{folder / METADATA} cannot be read as torch DCP metadata ({type(e).__name__}: "
            f"{first}); the file is corrupted: {_REMEDY}"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(
            f"{folder / METADATA} holds a {type(md).__name__}, not torch DCP metadata; the "
            f"file is corrupted: {_REMEDY}"
        )
    return md


def dcp_metadata(folder: Path, manifest: CheckpointManifest, *, trust_pickle: bool) -> Metadata:
    """DCP's ``Metadata`` for reading checkpoint ``folder``: from its manifest; for a
    checkpoint saved before the manifest recorded ``storage``, unpickled from
    ``.metadata`` with ``trust_pickle``, else refused. ``.metadata`` is checked first."""
    check_metadata_file(folder / METADATA)
    if manifest.storage:
        return metadata_from_manifest(manifest)
    if not trust_pickle:
        raise CheckpointError(
            f"{folder / 'manifest.json'} does not say where its entries lie (no 'storage': "
            "saved before areal_fn recorded it), so reading the checkpoint needs its DCP "
            f".metadata, a Python pickle; {trust_pickle_rule()}. Saved again (load, then "
            "save_checkpoint), it reads without that"
        )
    return unpickle_metadata(folder)
