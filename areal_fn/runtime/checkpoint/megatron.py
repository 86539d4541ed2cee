"""Interop with Megatron-Core's own ``dist_checkpointing`` (``torch_dist``) checkpoints."""

import functools
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    WriteItem,
    WriteItemType,
)

from areal_fn.errors import CheckpointError
from areal_fn.layouts.layout import Layout
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
from areal_fn.runtime.checkpoint.metadata import METADATA, trust_pickle_rule, unpickle_metadata
from areal_fn.sharding.box import Box

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
    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.strategy.allocation import ParallelDims

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
    path: "str | os.PathLike[str]", model: ModelSpec, *, trust_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """Canonical parameters of a Megatron-Core ``dist_checkpointing`` (``torch_dist``)
    checkpoint of ``model`` (a ``GPTModel`` under any TP/PP), bitwise.

    Layers are stacked along a leading dim (global layer index); rows of the embedding
    and output layer beyond ``vocab_size`` are padding and are not imported.

    Such a checkpoint locates its tensors only in ``.metadata``, a Python pickle, and
    unpickling runs any code a file holds: without ``trust_pickle=True`` it is refused.
    With it, ``.metadata`` is unpickled and the tensors read with
    ``torch.load(weights_only=True)``; pass it only for a checkpoint you saved or trust.
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
    from areal_fn.plans.convert import to_hf

    if not trust_pickle:
        raise CheckpointError(
            f"{folder / METADATA}: a Megatron-Core torch_dist checkpoint says where its tensors "
            f"lie only in this Python pickle; {trust_pickle_rule('trust_pickle=True')}. Or "
            "have its owner export it as HF safetensors, which need no trust"
        )
    layout = _mcore_layout(model)
    metadata = unpickle_metadata(folder)
    storage = _ChunkReader(folder, metadata=metadata, raw=False)
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


def _mcore_tensors(local: Mapping[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Megatron-Core's stored tensors from the unsharded local ones: layers stacked along
    a leading dim (global layer index), embedding and output layer padded with zero rows
    to ``rows``."""
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
    return tensors


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
    from areal_fn.plans.convert import to_megatron

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
    tensors = _mcore_tensors(to_megatron(source, layout, 0), rows)
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
