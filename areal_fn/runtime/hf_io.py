"""Hugging Face checkpoint IO: lazy sliced reads and streaming, atomic sharded writes.

Reading: :class:`HfCheckpoint` opens a directory holding ``model.safetensors`` or a
sharded set with ``model.safetensors.index.json``; ``read(name, box)`` memory-maps
only the requested slice of one tensor, so a rank converting its shard never loads
the whole model. Writing: :func:`write_hf_checkpoint` takes tensors one at a time,
cuts shards of at most ``max_shard_bytes``, writes the index and ``config.json``
into a temporary directory and renames it into place, so a crash never leaves a
half-written checkpoint under the final name.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..box import Box
from ..convert import check_canonical
from ..errors import ConversionError
from ..model import ModelSpec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HfCheckpoint:
    """A lazily read HF safetensors checkpoint (use as a context manager)."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"HF checkpoint {self.path} is not a directory")
        index = self.path / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise ConversionError(f"{index} is not a valid safetensors index ({e})") from None
            self._file_of: dict[str, str] = dict(weight_map)
        elif (self.path / SINGLE).exists():
            self._file_of = {}
            with safe_open(self.path / SINGLE, framework="pt") as f:
                for k in f.keys():
                    self._file_of[k] = SINGLE
        else:
            raise ConversionError(f"{self.path} holds neither {SINGLE} nor {INDEX}")
        self._handles: dict[str, object] = {}

    def _handle(self, fname: str):  # type: ignore[no-untyped-def]
        if fname not in self._handles:
            f = self.path / fname
            if not f.exists():
                raise ConversionError(f"{f} is named by the index but does not exist")
            self._handles[fname] = safe_open(f, framework="pt")
        return self._handles[fname]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return str(self._slice(name).get_dtype())

    def _slice(self, name: str):  # type: ignore[no-untyped-def]
        if name not in self._file_of:
            raise ConversionError(f"tensor {name!r} is not in the checkpoint {self.path}")
        return self._handle(self._file_of[name]).get_slice(name)

    def read(self, name: str, box: Box) -> torch.Tensor:
        """Only ``box`` of tensor ``name`` (memory-mapped, copied out)."""
        sl = self._slice(name)
        if box.ndim != len(sl.get_shape()):
            raise ConversionError(
                f"box {box} has {box.ndim} dims, {name!r} has shape {tuple(sl.get_shape())}"
            )
        if box.ndim == 0:
            return self._handle(self._file_of[name]).get_tensor(name)
        return sl[box.slices()]

    def read_full(self, name: str) -> torch.Tensor:
        return self._handle(self._file_of[name]).get_tensor(name)

    def check(self, model: ModelSpec, *, allow_missing: bool = False) -> None:
        """``ConversionError`` listing missing, extra and mis-shaped tensors against ``model``."""
        fake = {n: torch.empty(self.shape(n), device="meta") for n in self.names}
        check_canonical(fake, model.tensors, allow_missing=allow_missing)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HfCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_hf_checkpoint(
    path: "str | os.PathLike[str]",
    tensors: "Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]",
    *,
    config: Mapping[str, object] | None = None,
    model: ModelSpec | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
) -> Path:
    """Write tensors as a (sharded) HF safetensors checkpoint at ``path``, atomically.

    With ``model`` given, the names and shapes written must be exactly the model's
    canonical tensors (``ConversionError`` otherwise, and nothing is written).
    """
    dest = Path(path)
    if dest.exists() and not overwrite:
        raise ConversionError(
            f"{dest} already exists; pass overwrite=True or choose another directory"
        )
    if max_shard_bytes < 1:
        raise ConversionError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    items: Iterator[tuple[str, torch.Tensor]] = iter(
        tensors.items() if isinstance(tensors, Mapping) else tensors
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        shards: list[list[str]] = []
        current: dict[str, torch.Tensor] = {}
        size = 0
        total = 0
        seen: dict[str, tuple[int, ...]] = {}

        def flush() -> None:
            nonlocal current, size
            if current:
                save_file(
                    current, str(tmp / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"}
                )
                shards.append(list(current))
                current, size = {}, 0

        for name, t in items:
            if name in seen:
                raise ConversionError(f"tensor {name!r} given twice")
            seen[name] = tuple(t.shape)
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_shard_bytes:
                flush()
            current[name] = t.detach().contiguous()
            size += nbytes
            total += nbytes
        flush()
        if model is not None:
            fake = {n: torch.empty(s, device="meta") for n, s in seen.items()}
            check_canonical(fake, model.tensors)
        n = len(shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards):
            final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / f"shard-{i:05d}.tmp", tmp / final)
            for name in names:
                weight_map[name] = final
        if n > 1:
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        cfg = (
            dict(config)
            if config is not None
            else (model.hf_config() if model is not None else None)
        )
        if cfg is not None:
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
