"""Interop with Megatron-Core's own ``dist_checkpointing`` (``torch_dist``) checkpoints.

Where each tensor lies is :mod:`~areal_fn.runtime.checkpoint.megatron_keys`; this module
reads and writes the files. The readers take a dist checkpoint directory or a directory
Megatron-LM's ``--load`` reads (:mod:`~areal_fn.runtime.checkpoint.megatron_lm`).
"""

import functools
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from areal_fn.errors import CheckpointError
from areal_fn.layouts.layout import Layout, LocalTensor
from areal_fn.model.spec import ModelSpec
from areal_fn.runtime.checkpoint.dcp import (
    _ChunkReader,
    _owned,
    _SavePlanner,
    _single_process_dcp,
    _to_bytes,
    _write_item,
)
from areal_fn.runtime.checkpoint.files import _fsync_dir, _write_text_atomic
from areal_fn.runtime.checkpoint.inspect import _read_box
from areal_fn.runtime.checkpoint.megatron_keys import (
    LayerKeys,
    LayerSpec,
    McoreKey,
    default_layer_keys,
    mcore_keys,
    mcore_layout,
    pick_keys,
)
from areal_fn.runtime.checkpoint.megatron_lm import dist_checkpoint_dir, is_megatron_lm_dir
from areal_fn.runtime.checkpoint.metadata import METADATA, trust_pickle_rule, unpickle_metadata
from areal_fn.runtime.replace_dir import check_overwrite, replace_dir
from areal_fn.sharding.box import Box

__all__ = [
    "MCORE_METADATA",
    "export_megatron_checkpoint",
    "import_megatron_checkpoint",
    "is_megatron_checkpoint",
    "read_megatron_state",
    "torch_dist_owned",
]

#: ``metadata.json`` of a Megatron-Core ``torch_dist`` checkpoint.
MCORE_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
#: the local tensors whose stored rows beyond ``vocab_size`` are padding
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


#: The files of a torch_dist checkpoint: DCP's metadata and data, ``common.pt``, ``metadata.json``.
_TORCH_DIST_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp|common\.pt|metadata\.json")


def torch_dist_owned(names: Iterable[str]) -> Callable[[str], bool]:
    """Whether a file in the directory a torch_dist checkpoint replaces is one it
    replaces: one of ``names`` (``config.json`` and the files carried) or a file of the
    torch_dist format (:func:`~areal_fn.runtime.replace_dir.check_overwrite`)."""
    written = frozenset(names)
    return lambda name: name in written or _TORCH_DIST_FILE.fullmatch(name) is not None


def is_megatron_checkpoint(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` holds a Megatron-Core dist checkpoint (its ``metadata.json`` and
    ``.metadata``) or Megatron-LM's tracker file (the checkpoint it names is checked
    when read)."""
    folder = Path(path)
    flat = (folder / "metadata.json").is_file() and (folder / METADATA).is_file()
    return flat or is_megatron_lm_dir(folder)


def _backend(folder: Path) -> None:
    try:
        backend = json.loads((folder / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{folder} is not a Megatron-Core dist checkpoint: metadata.json cannot be read ({e})"
        ) from None
    if not isinstance(backend, dict) or backend.get("sharded_backend") != "torch_dist":
        got = backend.get("sharded_backend") if isinstance(backend, dict) else backend
        raise CheckpointError(
            f"{folder}: sharded_backend {got!r} is not supported; save with Megatron-Core's "
            "torch_dist backend"
        )


def _optimizer_entries(folder: Path, stored: Mapping[str, Any], drop: bool) -> None:
    found = sorted(k for k in stored if k.startswith("optimizer."))
    if found and not drop:
        raise CheckpointError(
            f"{folder}: the Megatron checkpoint holds optimizer state ({len(found)} "
            f"{'entry' if len(found) == 1 else 'entries'}, "
            f"e.g. {found[0]!r}), which the import does not carry: Megatron's optimizers "
            "store it per data-parallel bucket or per Megatron parameter, not per canonical "
            "tensor; pass drop_optimizer=True to import the parameters alone"
        )
    if drop and not found:
        raise CheckpointError(
            f"{folder}: the Megatron checkpoint holds no optimizer state, so drop_optimizer=True "
            "has nothing to drop: pass drop_optimizer=False"
        )


def _stored_box(lt: LocalTensor, where: McoreKey) -> Box:
    return Box(
        ranges=(*((i, i + 1) for i in where.prefix), *((0, d) for d in lt.shape)),
    )


def _read_state(
    folder: Path, model: ModelSpec, drop_optimizer: bool
) -> tuple[dict[str, torch.Tensor], Layout]:
    """The local tensors of :func:`mcore_layout` (of the spec the checkpoint was saved
    with) read from ``folder``, and that layout."""
    metadata = unpickle_metadata(folder)
    stored = metadata.state_dict_metadata
    _optimizer_entries(folder, stored, drop_optimizer)
    tensors = {k for k, v in stored.items() if isinstance(v, TensorStorageMetadata)}
    spec, _, keys = pick_keys(model, tensors, str(folder))
    layout = mcore_layout(model, spec)
    storage = _ChunkReader(folder, metadata=metadata, raw=False)
    storage.set_up_storage_reader(metadata, True)
    state: dict[str, torch.Tensor] = {}
    for lt in layout.local_tensors(0):
        where = keys[lt.name]
        md = stored[where.key]
        assert isinstance(md, TensorStorageMetadata)
        size = tuple(md.size)
        want = (*where.prefix_sizes, *lt.shape)
        vocab = lt.name in _VOCAB
        ok = size == want or (
            vocab and len(size) == len(want) and size[0] >= want[0] and size[1:] == want[1:]
        )
        if not ok:
            raise CheckpointError(
                f"{folder}: {where.key} has shape {size}, {model.model_type} with hidden_size="
                f"{model.hidden_size}, {model.num_layers} layers needs {want}"
                + (" (rows >= vocab_size)" if vocab else "")
            )
        chunks = tuple(
            Box(ranges=tuple((o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True)))
            for c in md.chunks
        )
        box = _stored_box(lt, where)
        t = _read_box(storage, where.key, chunks, box, md.properties.dtype, str(folder))
        state[lt.name] = t.reshape(lt.shape)
    return state, layout


def import_megatron_checkpoint(
    path: "str | os.PathLike[str]",
    model: ModelSpec,
    *,
    trust_pickle: bool = False,
    drop_optimizer: bool = False,
) -> dict[str, torch.Tensor]:
    """Canonical parameters of a Megatron-Core ``dist_checkpointing`` (``torch_dist``)
    checkpoint of ``model`` (a ``GPTModel`` under any TP/PP/EP/ETP), bitwise. ``path``
    is the checkpoint's directory or a directory Megatron-LM's ``--load`` reads (the
    checkpoint its ``latest_checkpointed_iteration.txt`` names).

    Dense and MoE models; experts stored per expert (any EP at save time), layers
    stacked or per layer, the Transformer-Engine or the local layer spec's key names:
    all read from the stored keys (:mod:`~areal_fn.runtime.checkpoint.megatron_keys`).
    Rows of the embedding and output layer beyond ``vocab_size`` are padding and are
    not imported. Optimizer state in the checkpoint is refused unless
    ``drop_optimizer=True`` (then only the parameters are read).

    Such a checkpoint locates its tensors only in ``.metadata``, a Python pickle, and
    unpickling runs any code a file holds: without ``trust_pickle=True`` it is refused.
    With it, ``.metadata`` is unpickled and the tensors read with
    ``torch.load(weights_only=True)``; pass it only for a checkpoint you saved or trust.
    """
    from areal_fn.plans.convert import to_hf

    state, layout = read_megatron_state(
        path, model, trust_pickle=trust_pickle, drop_optimizer=drop_optimizer
    )
    return to_hf({0: state}, layout)


def read_megatron_state(
    path: "str | os.PathLike[str]",
    model: ModelSpec,
    *,
    trust_pickle: bool = False,
    drop_optimizer: bool = False,
) -> tuple[dict[str, torch.Tensor], Layout]:
    """What :func:`import_megatron_checkpoint` reads before ``to_hf``: the one rank's
    local tensors of the unsharded layout it returns too (for ``iter_to_hf``)."""
    folder = dist_checkpoint_dir(path)
    _backend(folder)
    if not trust_pickle:
        raise CheckpointError(
            f"{folder / METADATA}: a Megatron-Core torch_dist checkpoint says where its tensors "
            f"lie only in this Python pickle; {trust_pickle_rule('trust_pickle=True')}. Or "
            "have its owner export it as HF safetensors, which need no trust"
        )
    return _read_state(folder, model, drop_optimizer)


def _items(
    layout: Layout,
    keys: Mapping[str, McoreKey],
    read: Callable[[str, Box], torch.Tensor],
    rows: int,
    dtypes: Mapping[str, torch.dtype],
    progress: Callable[[str], None] | None,
) -> tuple[list[WriteItem], dict[MetadataIndex, Callable[[], Any]]]:
    """One write item per local tensor (its chunk of the stored tensor, materialised
    when DCP writes it), a zero chunk for the vocabulary padding rows, and the linear
    modules' ``_extra_state`` objects."""
    items: list[WriteItem] = []
    data: dict[MetadataIndex, Callable[[], Any]] = {}
    extras: list[str] = []
    for lt in layout.local_tensors(0):
        where = keys[lt.name]
        shape = (*where.prefix_sizes, *lt.shape)
        dtype = _dtype(lt, dtypes)
        if lt.name in _VOCAB and rows > lt.shape[0]:
            shape = (rows, *lt.shape[1:])
            pad = Box(ranges=((lt.shape[0], rows), *((0, d) for d in lt.shape[1:])))
            item = _write_item(where.key, pad, shape, dtype)
            items.append(item)
            data[item.index] = functools.partial(torch.zeros, pad.shape, dtype=dtype)
        item = _write_item(where.key, _stored_box(lt, where), shape, dtype)
        items.append(item)
        data[item.index] = functools.partial(_chunk, lt, read, where, dtype, progress)
        if where.extra_state is not None and where.extra_state not in extras:
            extras.append(where.extra_state)
    for key in extras:
        item = WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
        items.append(item)
        data[item.index] = functools.partial(io.BytesIO, _to_bytes([None]))
    return items, data


def _dtype(lt: LocalTensor, dtypes: Mapping[str, torch.dtype]) -> torch.dtype:
    """The dtype ``lt`` is written in: its source's (the first canonical piece)."""
    from areal_fn.model.tensor_spec import torch_dtype

    first = next((p.canonical for p in lt.pieces if p.canonical is not None), "")
    return dtypes[first] if first in dtypes else torch_dtype(lt.dtype)


def _chunk(
    lt: LocalTensor,
    read: Callable[[str, Box], torch.Tensor],
    where: McoreKey,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None,
) -> torch.Tensor:
    from areal_fn.plans.convert import materialize

    t = materialize(lt, read).reshape((1,) * len(where.prefix) + lt.shape)
    if t.dtype != dtype:
        raise CheckpointError(
            f"{lt.name}: the source holds {t.dtype}, the checkpoint's metadata says {dtype} "
            "(nothing is cast); pass dtypes= with the source's dtypes"
        )
    if progress is not None:
        progress(lt.name)
    return _owned(t)


def export_megatron_checkpoint(
    source: "Mapping[str, torch.Tensor] | Callable[[str, Box], torch.Tensor]",
    model: ModelSpec,
    dest: "str | os.PathLike[str]",
    *,
    vocab_size_padded: int | None = None,
    layer_spec: LayerSpec = "te",
    layer_keys: LayerKeys | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write canonical parameters (a mapping, a ``CheckpointReader``, an
    ``HfCheckpoint.read``, any reader) as a Megatron-Core ``torch_dist`` checkpoint that
    ``dist_checkpointing.load`` reads into a ``GPTModel`` of ``model`` under any
    TP/PP/EP/ETP; written atomically (temporary directory, fsync, rename), one tensor
    in memory at a time. ``vocab_size_padded`` is the embedding rows of the target
    ``GPTModel`` (its padded vocabulary; default ``vocab_size``), padding rows zero.
    ``layer_spec`` is the layer spec of the model that will load it (``te``: the
    Transformer-Engine spec, Megatron-LM's on GPUs; ``local``: Megatron-Core's local
    spec): they name a MoE layer's ``pre_mlp_layernorm`` differently. ``layer_keys``
    (default: ``stacked`` when every layer is alike, else ``per-layer``) must be what
    that model stores: ``per-layer`` when its ``moe_layer_freq`` is a list.
    Tensors are written in their source's dtype, nothing cast: a mapping's own, else
    ``dtypes`` (canonical name -> dtype; default the model's). ``progress`` hears each
    local tensor's name as it is written. Parameters only: no optimizer state is
    written, and the common state (``common.pt``) is empty: ``dest`` is what
    Megatron-Core's ``dist_checkpointing.load`` reads (Megatron-LM's ``--load`` reads
    what ``convert_to_torch_dist`` writes). An existing ``dest`` needs
    ``overwrite=True`` and is then replaced whole; it may hold only torch_dist files
    (:func:`~areal_fn.runtime.replace_dir.check_overwrite`).
    """
    from areal_fn.plans.convert import check_canonical, mapping_reader

    out = Path(dest)
    check_overwrite(
        out,
        overwrite=overwrite,
        owned=torch_dist_owned(()),
        kind="torch_dist checkpoint",
        error=CheckpointError,
    )
    rows = vocab_size_padded if vocab_size_padded is not None else model.vocab_size
    if rows < model.vocab_size:
        raise CheckpointError(
            f"vocab_size_padded={rows} is smaller than vocab_size={model.vocab_size}"
        )
    layout = mcore_layout(model, layer_spec)
    keys = mcore_keys(model, layer_spec, layer_keys or default_layer_keys(model))
    if isinstance(source, Mapping):
        check_canonical(source, layout.canonical)
        read = mapping_reader(source)
        dtypes = {n: t.dtype for n, t in source.items()}
    else:
        read = source
    items, data = _items(layout, keys, read, rows, dtypes or {}, progress)
    _write(out, items, data)
    return out


def _write(out: Path, items: list[WriteItem], data: dict[MetadataIndex, Callable[[], Any]]) -> None:
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
        replace_dir(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
