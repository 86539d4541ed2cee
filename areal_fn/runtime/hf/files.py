"""The files of a Hugging Face model directory besides its weights, carried unchanged.

An HF model directory holds its weights (``model.safetensors``, or shards and
``model.safetensors.index.json``), ``config.json``, and files that conversion and
training leave as they are: ``generation_config.json``, the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``vocab.json``, ``merges.txt``, ``tokenizer.model``, ``added_tokens.json``),
``chat_template.jinja``, remote code, ``README.md``, a licence. :func:`read_hf_files`
reads ``config.json`` and every such file, byte for byte, into an :class:`HfFiles`;
``areal-fn convert`` (both ways), ``save_checkpoint(hf=...)`` and ``export_hf`` write
them back unchanged, ``config.json`` included.

**Carried**: every regular top-level file that is not a weight file. **Not carried**:
the weights the conversion reads (it writes new ones) and, listed in
:attr:`HfFiles.skipped` with the reason, other weight files (``*.safetensors``,
``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.gguf``, ``*.h5``, ``*.msgpack``,
``*.onnx``, ``*.npy``, ``*.npz``, ``*.index.json``: they would hold stale weights),
subdirectories and hidden files.

In a checkpoint directory the files live under ``hf/`` (``hf/config.json``,
``hf/tokenizer.json``, ...), listed with their sha256 in the manifest like every other
file; :func:`checkpoint_hf_files` reads them back.
"""

import json
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import attrs

from areal_fn.errors import ConversionError
from areal_fn.plans.checkpoint import CheckpointManifest
from areal_fn.typecheck import beartype

__all__ = [
    "CONFIG",
    "HF_DIR",
    "HfFiles",
    "carried_files",
    "checkpoint_hf_files",
    "describe_checkpoint_hf_files",
    "is_weight_file",
    "read_hf_files",
    "write_checkpoint_hf_files",
]

CONFIG = "config.json"
#: The folder of a checkpoint directory holding its HF files.
HF_DIR = "hf"
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".h5",
    ".msgpack",
    ".onnx",
    ".npy",
    ".npz",
    ".index.json",
)
_PathLike = str | os.PathLike[str]


@beartype
def is_weight_file(name: str) -> bool:
    """True for names of weight files (``*.safetensors``, ``*.bin``, ``*.index.json``, ...)."""
    return name.endswith(_WEIGHT_SUFFIXES)


def _check_config(_inst: object, _attr: object, value: bytes) -> None:
    try:
        parsed = json.loads(value)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(
            f"HfFiles.config is not JSON text ({e}); give config.json as read"
        ) from None
    if not isinstance(parsed, dict):
        raise ConversionError(
            f"HfFiles.config holds a JSON {type(parsed).__name__}, not an object (a config.json)"
        )


def carried_files(
    value: "Mapping[str, bytes] | Iterable[tuple[str, bytes]]",
) -> tuple[tuple[str, bytes], ...]:
    """``(name, content)`` pairs sorted by name; ``ConversionError`` for a name that is not
    a plain top-level file name, is hidden, is ``config.json`` or a weight file, or repeats."""
    items = list(value.items() if isinstance(value, Mapping) else value)
    names = [n for n, _ in items]
    for name, data in items:
        plain = name not in ("", ".", "..") and "/" not in name and "\\" not in name
        if not plain or name.startswith(".") or name == CONFIG or is_weight_file(name):
            raise ConversionError(
                f"HfFiles.files names {name!r}; carried files are plain top-level names, not "
                f"hidden, not {CONFIG} (that is HfFiles.config) and not weight files"
            )
        if not isinstance(data, bytes):
            raise ConversionError(f"HfFiles.files[{name!r}] is a {type(data).__name__}, not bytes")
    if len(set(names)) != len(names):
        raise ConversionError(f"HfFiles.files names a file twice: {sorted(names)}")
    return tuple(sorted(items))


def _skipped(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(n), str(why)) for n, why in value))


@attrs.frozen(kw_only=True)
class HfFiles:
    """``config.json`` and the other non-weight files of an HF model directory, as bytes.

    ``files`` are ``(name, content)`` pairs sorted by name; ``skipped`` says, per name,
    why something the directory holds is not carried (empty when not read from a
    directory). Build one with :func:`read_hf_files`, or :meth:`of_config` from a config
    dict alone.
    """

    config: bytes = attrs.field(validator=_check_config, repr=False)
    files: tuple[tuple[str, bytes], ...] = attrs.field(
        default=(), converter=carried_files, repr=False
    )
    skipped: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_skipped)

    @classmethod
    def of_config(cls, config: Mapping[str, object]) -> "HfFiles":
        """Only a ``config.json``, written from ``config`` (sorted keys, indented)."""
        return cls(config=(json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode())

    @property
    def config_dict(self) -> dict[str, object]:
        out: dict[str, object] = json.loads(self.config)
        return out

    @property
    def names(self) -> tuple[str, ...]:
        """``config.json`` and the carried files' names."""
        return (CONFIG, *(n for n, _ in self.files))

    def __str__(self) -> str:
        text = "carried " + ", ".join(self.names)
        if self.skipped:
            text += "; not carried: " + ", ".join(f"{n} ({why})" for n, why in self.skipped)
        return text


@beartype
def read_hf_files(
    path: _PathLike,
    *,
    weights: Collection[str] = (),
    config: Mapping[str, object] | None = None,
) -> HfFiles:
    """``path/config.json`` and every other carried file of ``path`` (see the module docstring).

    ``weights`` are the names of the weight files the caller converts: not carried and
    not listed as skipped. When ``path`` has no ``config.json``: ``config`` stands in for
    it (and ``skipped`` says so), or without ``config`` a ``ConversionError``.
    """
    folder = Path(path)
    files: list[tuple[str, bytes]] = []
    skipped: list[tuple[str, str]] = []
    if (folder / CONFIG).is_file():
        raw = (folder / CONFIG).read_bytes()
    elif config is not None:
        raw = HfFiles.of_config(config).config
        skipped.append((CONFIG, f"absent from {folder}; regenerated from the model spec"))
    else:
        raise ConversionError(
            f"{folder} has no {CONFIG}; an HF model directory needs one (the model's config)"
        )
    for p in sorted(folder.iterdir()):
        name = p.name
        if name == CONFIG or name in weights:
            continue
        if name.startswith("."):
            skipped.append((name, "hidden"))
        elif p.is_dir():
            skipped.append((name, "a directory; only top-level files are carried"))
        elif not p.is_file():
            skipped.append((name, "not a regular file"))
        elif is_weight_file(name):
            skipped.append((name, "weights; the converted or saved weights replace them"))
        else:
            files.append((name, p.read_bytes()))
    try:
        return HfFiles(config=raw, files=files, skipped=skipped)
    except ConversionError as e:
        raise ConversionError(f"{folder / CONFIG}: {e}") from None


# -- in a checkpoint directory ---------------------------------------------------------


@beartype
def write_checkpoint_hf_files(folder: Path, hf: HfFiles) -> list[Path]:
    """Write ``hf`` into ``folder/hf/`` (fsync'ed); the paths written."""
    out = folder / HF_DIR
    out.mkdir()
    written = []
    for name, data in ((CONFIG, hf.config), *hf.files):
        with open(out / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        written.append(out / name)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _listed(manifest: CheckpointManifest) -> list[str]:
    prefix = HF_DIR + "/"
    return [f.path[len(prefix) :] for f in manifest.files if f.path.startswith(prefix)]


@beartype
def checkpoint_hf_files(folder: _PathLike, manifest: CheckpointManifest) -> HfFiles | None:
    """The HF files saved with the checkpoint in ``folder`` (None: it was saved without).

    Reads the files ``manifest`` lists under ``hf/``; check them first
    (``verify_checkpoint``) when the directory may have changed.
    """
    names = _listed(manifest)
    if CONFIG not in names:
        return None
    base = Path(folder) / HF_DIR
    return HfFiles(
        config=(base / CONFIG).read_bytes(),
        files=[(n, (base / n).read_bytes()) for n in names if n != CONFIG],
    )


@beartype
def describe_checkpoint_hf_files(manifest: CheckpointManifest) -> str:
    """One line: which HF files the checkpoint holds, or what an HF export will lack."""
    names = _listed(manifest)
    if CONFIG in names:
        rest = [n for n in names if n != CONFIG]
        return f"hf files (exported unchanged): {', '.join([CONFIG, *rest])}"
    return (
        "hf files: none saved; an HF export regenerates config.json from the model spec "
        "(keys such as eos_token_id are lost) and has no tokenizer or generation config; "
        "save with hf=read_hf_files(<model dir>) to keep them"
    )
