"""Hugging Face checkpoint IO: lazy sliced reads and streaming, atomic sharded writes.

Reading: :class:`HfCheckpoint` opens a directory holding ``model.safetensors`` or a
sharded set with ``model.safetensors.index.json``; ``read(name, box)`` memory-maps
only the requested slice of one tensor, so a rank converting its shard never loads
the whole model. Writing: :func:`write_hf_checkpoint` takes tensors one at a time,
cuts shards of at most ``max_shard_bytes``, writes the index and ``config.json``
into a temporary directory and renames it into place, so a crash never leaves a
half-written checkpoint under the final name; ``config.json`` and the other non-weight
files (tokenizer, generation config) are written into it as given.
"""

import errno
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from areal_fn.errors import ConversionError
from areal_fn.model.mtp import mtp_names
from areal_fn.model.quantized import Fp8Format
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import check_canonical
from areal_fn.runtime.hf.text_model import TextView, text_view
from areal_fn.runtime.replace_dir import check_overwrite, new_output_dir, replace_dir
from areal_fn.sharding.box import Box

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: The weight files of an HF checkpoint this module writes (one file, or shards and index).
_HF_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json")


def hf_owned(names: Iterable[str]) -> Callable[[str], bool]:
    """Whether a file in the directory an HF checkpoint replaces is one the checkpoint
    replaces: one of ``names`` (``config.json`` and the files carried) or weights of
    the HF layout (``model.safetensors``, ``model-*-of-*.safetensors``, the index)."""
    written = frozenset(names)
    return lambda name: name in written or _HF_WEIGHTS.fullmatch(name) is not None


# -- damaged files and failed writes --------------------------------------------------


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _unreadable(path: Path, detail: str, *, truncated: bool) -> ConversionError:
    damage = "truncated or corrupted" if truncated else "corrupted"
    return ConversionError(
        f"{path} is not a readable safetensors file: {detail}; the file is {damage}: download "
        "or save it again"
    )


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """The JSON header of a safetensors file, where its data starts, and the file's size.

    ``ConversionError`` saying what is wrong otherwise: shorter than its header length
    or its tensors' data say (truncated), a header that is not JSON (garbled).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _unreadable(
                    path,
                    f"it has {size} bytes, not even the 8 of the header length",
                    truncated=True,
                )
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise _unreadable(
                    path, f"its header length says {n} bytes, {size - 8} follow", truncated=True
                )
            raw = f.read(n)
    except OSError as e:
        raise ConversionError(f"{path} cannot be read ({_reason(e)})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        end = 0
        for name, entry in header.items():
            if name != "__metadata__":
                _begin, stop = (int(x) for x in entry["data_offsets"])
                end = max(end, stop)
    except (ValueError, KeyError, TypeError) as e:
        raise _unreadable(path, f"its header is not JSON ({_reason(e)})", truncated=False) from None
    if 8 + n + end > size:
        raise _unreadable(
            path,
            f"its tensors' data ends at byte {8 + n + end}, the file has {size} bytes",
            truncated=True,
        )
    return header, 8 + n, size


def _open(path: Path) -> Any:
    """``safe_open`` of ``path``; ``ConversionError`` naming the file and its defect."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        read_safetensors_header(path)  # raises, saying what is wrong, when it can tell
        raise _unreadable(path, f"safetensors refuses it ({_reason(e)})", truncated=False) from None


def is_write_failure(e: BaseException) -> bool:
    """An error of the OS writing a file (safetensors reports its own as SafetensorError)."""
    return isinstance(e, (OSError, SafetensorError))


def write_error(
    e: BaseException, what: "str | os.PathLike[str]", *, dest: Path, left: str
) -> ConversionError:
    """``ConversionError`` for a failed write of ``what`` under ``dest``: the OS's reason,
    what to do about it, and what ``left`` (say) of the destination."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and (m := re.search(r"\(os error (\d+)\)", str(e))):
        code = int(m.group(1))
    reason = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})" if code else _reason(e)
    if code in (errno.ENOSPC, errno.EDQUOT):
        remedy = f"free space on the disk of {dest.parent} or write elsewhere"
    elif code == errno.EFBIG:
        remedy = "raise the limit on file size (ulimit -f) or write elsewhere"
    else:
        remedy = f"check that {dest.parent} can be written to, or write elsewhere"
    return ConversionError(f"cannot write {what}: {reason}; {remedy}; {left}")


def _written(e: BaseException, tmp: Path, dest: Path) -> Path:
    """The destination file a failed write in the temporary ``tmp`` was for."""
    name = Path(str(e.filename)) if isinstance(e, OSError) and e.filename else None
    if name is None or name.parent != tmp:
        return dest
    n = name.name
    return dest / (n[1:-4] if n.startswith(".") and n.endswith(".tmp") else n)


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
            with _open(self.path / SINGLE) as f:
                for k in f.keys():
                    self._file_of[k] = SINGLE
        else:
            raise ConversionError(f"{self.path} holds neither {SINGLE} nor {INDEX}")
        #: how a multimodal checkpoint's stored names read as its text model's
        self.text: TextView = text_view(self.path, self._file_of)
        self._file_of = {self.text.name(n): f for n, f in self._file_of.items()}
        self._handles: dict[str, object] = {}
        from areal_fn.runtime.hf.fp8_io import quantized_weights

        stored = tuple(self._file_of)
        #: the quantised weights (FP8, MXFP4) its config.json declares, read dequantised
        self.quantized = quantized_weights(
            self.path, stored, self._stored_shape, self._stored_dtype
        )
        q = self.quantized
        self._quantized = q.names if q is not None else frozenset()
        hidden = q.hidden if q is not None else frozenset()
        shown = [n for n in stored if n not in hidden]
        self._names = (*shown, *sorted(self._quantized - set(shown)))

    def _handle(self, fname: str):  # type: ignore[no-untyped-def]
        if fname not in self._handles:
            f = self.path / fname
            if not f.exists():
                raise ConversionError(f"{f} is named by the index but does not exist")
            self._handles[fname] = _open(f)
        return self._handles[fname]

    @property
    def names(self) -> tuple[str, ...]:
        """The checkpoint's tensors (an FP8 checkpoint's weights, not their scales)."""
        return self._names

    @property
    def stored(self) -> tuple[str, ...]:
        """Every tensor the files hold (an FP8 checkpoint's scales too; renamed: ``text``)."""
        return tuple(self._file_of)

    @property
    def files(self) -> tuple[str, ...]:
        """The weight files read: the safetensors files (and the index when sharded)."""
        index = (INDEX,) if (self.path / INDEX).exists() else ()
        return (*index, *sorted(set(self._file_of.values())))

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._quantized:
            assert self.quantized is not None
            return self.quantized.shape(name, self._stored_shape)
        return self._stored_shape(name)

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The dtype ``read`` gives (an FP8 weight's: the config's ``torch_dtype``)."""
        if name in self._quantized:
            assert self.quantized is not None
            return str(self.quantized.dtype).removeprefix("torch.")
        return self._stored_dtype(name)

    def _stored_dtype(self, name: str) -> str:
        return str(self._slice(name).get_dtype())

    def _slice(self, name: str):  # type: ignore[no-untyped-def]
        if name not in self._file_of:
            raise ConversionError(f"tensor {name!r} is not in the checkpoint {self.path}")
        return self._handle(self._file_of[name]).get_slice(self.text.stored(name))

    def read(self, name: str, box: Box) -> torch.Tensor:
        """Only ``box`` of tensor ``name`` (memory-mapped, copied out; a quantised
        weight's values and scales of the blocks the box touches, dequantised)."""
        if name in self._quantized:
            assert self.quantized is not None
            if box.ndim != len(self.shape(name)):
                raise ConversionError(
                    f"box {box} has {box.ndim} dims, {name!r} has shape {self.shape(name)}"
                )
            return self.quantized.read(name, box, lambda n, b: self._slice(n)[b.slices()])
        sl = self._slice(name)
        if box.ndim != len(sl.get_shape()):
            raise ConversionError(
                f"box {box} has {box.ndim} dims, {name!r} has shape {tuple(sl.get_shape())}"
            )
        return sl[box.slices()] if box.ndim else self.read_full(name)

    def read_full(self, name: str) -> torch.Tensor:
        if name in self._quantized:
            return self.read(name, Box.full(self.shape(name)))
        return self._handle(self._file_of[name]).get_tensor(self.text.stored(name))

    def check(
        self,
        model: ModelSpec,
        *,
        allow_missing: bool = False,
        drop_mtp: bool = False,
        text_only: bool = False,
    ) -> tuple[str, ...]:
        """``ConversionError`` listing missing, extra and mis-shaped tensors against ``model``.

        ``drop_mtp=True`` leaves out the tensors of the multi-token-prediction layers that
        ``model`` does not hold (``model.layers.{i}.*``, ``i >= num_layers + mtp_layers``,
        of a family that has them) and returns their names; without it (the default) they
        are refused as unexpected. ``text_only=True`` leaves out the tensors of a multimodal
        checkpoint that are not its text model (:mod:`~areal_fn.runtime.hf.text_model`),
        refused without it, and returns them too."""
        left = self.text.left_out(text_only=text_only, drop_mtp=drop_mtp)
        dropped = (mtp_names(self.names, model) if drop_mtp else ()) + left
        fake = {
            n: torch.empty(self.shape(n), device="meta") for n in self.names if n not in dropped
        }
        check_canonical(fake, model.tensors, allow_missing=allow_missing)
        return dropped

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
    config: Mapping[str, object] | bytes | None = None,
    model: ModelSpec | None = None,
    files: "Mapping[str, bytes] | Iterable[tuple[str, bytes]]" = (),
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    fp8: "Fp8Format | None" = None,
) -> Path:
    """Write tensors as a (sharded) HF safetensors checkpoint at ``path``, atomically.

    With ``model`` given, the names and shapes written must be exactly the model's
    canonical tensors (``ConversionError`` otherwise, and nothing is written).
    ``config`` is written as ``config.json``: bytes as they are (the file as read), a
    mapping with sorted keys; absent, ``model.hf_config()``. ``files`` (name, content)
    are written next to it byte for byte (``generation_config.json``, tokenizer files:
    see :mod:`areal_fn.runtime.hf.files`). An existing ``path`` needs ``overwrite=True``
    and is then replaced whole (:func:`~areal_fn.runtime.replace_dir.check_overwrite`):
    it may hold only the files the new checkpoint holds and HF weight files.

    ``fp8`` (an :class:`~areal_fn.model.quantized.Fp8Format`) writes block-quantised FP8
    weights: each tensor :func:`~areal_fn.model.quantized.is_fp8_quantized` names as
    ``float8_e4m3fn`` values and its ``weight_scale_inv``, with the format's
    ``quantization_config`` in ``config.json``. Without it, a ``config.json`` that says
    FP8 (or MXFP4) loses its ``quantization_config`` when no tensor of that format is
    written (the weights are then in their own dtype, as transformers must read them).
    """
    from areal_fn.runtime.hf.files import carried_files
    from areal_fn.runtime.hf.fp8_io import noting_quantised, quantized_stream, written_quantization

    extra = carried_files(files)
    dest = Path(path)
    _check_write(dest, config, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    check_overwrite(
        dest,
        overwrite=overwrite,
        owned=hf_owned(["config.json", *(name for name, _ in extra)]),
        kind="HF checkpoint",
        error=ConversionError,
    )
    items: Iterator[tuple[str, torch.Tensor]] = iter(
        tensors.items() if isinstance(tensors, Mapping) else tensors
    )
    scales: set[str] = set()
    if fp8 is not None:
        items = quantized_stream(items, fp8, scales)
    written: set[str] = set()
    items = noting_quantised(items, written)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_output_dir(dest)
    left = (
        f"nothing was written to {dest}"
        if not dest.exists()
        else f"{dest} holds what it held before"
    )
    try:  # reading the tensors, writing the shards (their write failures named there)
        shards, shapes, total = _write_shards(
            items, tmp, dest=dest, max_shard_bytes=max_shard_bytes, left=left
        )
        if model is not None:
            fake = {n: torch.empty(s, device="meta") for n, s in shapes.items() if n not in scales}
            check_canonical(fake, model.tensors)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:  # completing the checkpoint in ``tmp``, then putting it in place
        config = written_quantization(config, model, fp8, written=written)
        _complete(tmp, shards, total, config=config, model=model, files=extra)
        replace_dir(tmp, dest)
        return dest
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise write_error(e, _written(e, tmp, dest), dest=dest, left=left) from None
        raise


def _check_write(
    dest: Path,
    config: Mapping[str, object] | bytes | None,
    *,
    overwrite: bool,
    max_shard_bytes: int,
) -> None:
    """``ConversionError`` for arguments of :func:`write_hf_checkpoint` it must refuse."""
    from areal_fn.runtime.hf.files import HfFiles

    if isinstance(config, bytes):
        HfFiles(config=config)  # a JSON object, or ConversionError
    if max_shard_bytes < 1:
        raise ConversionError(f"max_shard_bytes={max_shard_bytes} must be >= 1")


def _write_shards(
    items: Iterator[tuple[str, torch.Tensor]],
    tmp: Path,
    *,
    dest: Path,
    max_shard_bytes: int,
    left: str,
) -> tuple[list[list[str]], dict[str, tuple[int, ...]], int]:
    """Stream ``items`` into ``tmp/shard-*.tmp`` files of at most ``max_shard_bytes`` each
    (a bigger tensor alone); each shard's names, every name's shape, and the total bytes."""
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    total = 0
    seen: dict[str, tuple[int, ...]] = {}
    for name, t in items:
        if name in seen:
            raise ConversionError(f"tensor {name!r} given twice")
        seen[name] = tuple(t.shape)
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(_save_shard(current, tmp, len(shards), dest=dest, left=left))
            current, size = {}, 0
        current[name] = t.detach().contiguous()
        size += nbytes
        total += nbytes
    if current:
        shards.append(_save_shard(current, tmp, len(shards), dest=dest, left=left))
    return shards, seen, total


def _save_shard(
    tensors: dict[str, torch.Tensor], tmp: Path, i: int, *, dest: Path, left: str
) -> list[str]:
    """Write shard ``i`` as ``tmp/shard-{i:05d}.tmp``; its tensor names."""
    try:
        save_file(tensors, str(tmp / f"shard-{i:05d}.tmp"), metadata={"format": "pt"})
    except BaseException as e:
        if is_write_failure(e):
            raise write_error(e, f"{dest} (its shard {i + 1})", dest=dest, left=left) from None
        raise
    return list(tensors)


def _complete(
    tmp: Path,
    shards: list[list[str]],
    total: int,
    *,
    config: Mapping[str, object] | bytes | None,
    model: ModelSpec | None,
    files: Iterable[tuple[str, bytes]],
) -> None:
    """Give the shards in ``tmp`` their final names, write the index (when sharded),
    ``config.json`` and the carried ``files``, and sync every file to disk."""
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
    _write_config(tmp, config, model)
    for name, data in files:
        (tmp / name).write_bytes(data)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _write_config(
    tmp: Path, config: Mapping[str, object] | bytes | None, model: ModelSpec | None
) -> None:
    """``tmp/config.json``: ``config`` as given (bytes), a mapping with sorted keys, else
    the model's ``hf_config()``; nothing without either."""
    if isinstance(config, bytes):
        (tmp / "config.json").write_bytes(config)
        return
    cfg = dict(config) if config is not None else (model.hf_config() if model is not None else None)
    if cfg is not None:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


class Tally:
    """Counts the tensors and bytes of a stream of ``(name, tensor)`` as it passes
    (:meth:`count`), calling ``progress(name)`` for each."""

    def __init__(self, progress: Callable[[str], None] | None = None) -> None:
        self.tensors = 0
        self.bytes = 0
        self._progress = progress

    def count(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in items:
            self.tensors += 1
            self.bytes += t.numel() * t.element_size()
            if self._progress is not None:
                self._progress(name)
            yield name, t
