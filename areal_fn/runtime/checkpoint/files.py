"""Checkpoint directories on disk: names, the ``latest`` pointer, manifests, checksums
(computed by :mod:`~areal_fn.runtime.checkpoint.hashing`)."""

import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal_fn.errors import CheckpointError
from areal_fn.plans.checkpoint import (
    CheckpointManifest,
    FileDigest,
)
from areal_fn.plans.checkpoint.keyed import check_keyed_digest
from areal_fn.runtime.checkpoint.hashing import file_digest
from areal_fn.runtime.checkpoint.metadata import METADATA, check_metadata_file
from areal_fn.runtime.hf.files import HF_DIR

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# -- files ---------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _data_files(folder: Path) -> list[str]:
    """Every file but the manifest, relative to ``folder``: DCP's, and the HF files in ``hf/``."""
    top = [p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST]
    hf = folder / HF_DIR
    sub = [f"{HF_DIR}/{p.name}" for p in hf.iterdir() if p.is_file()] if hf.is_dir() else []
    return sorted(top + sub)


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


def check_sizes(folder: Path, manifest: CheckpointManifest) -> None:
    """Every listed file present with the size the manifest says (no read: what ``verify=False``
    still checks, so that a truncated file is refused before any tensor is touched)."""
    for want in manifest.files:
        problem = _check_size(folder, want)
        if problem:
            raise CheckpointError(problem)


def _check_size(folder: Path, want: FileDigest) -> str | None:
    p = folder / want.path
    if not p.is_file():
        return f"{p} is listed in the manifest but missing; the checkpoint is incomplete"
    size = p.stat().st_size
    if size != want.size:
        return (
            f"{p} has {size} bytes, the manifest says {want.size}; the file is truncated or "
            "corrupted: restore it from a copy or load another step"
        )
    return None


def _check_file(folder: Path, want: FileDigest) -> str | None:
    problem = _check_size(folder, want)
    if problem:
        return problem
    p = folder / want.path
    got = file_digest(p, want.path, want.algorithm, sync=False).digest
    if got != want.digest:
        return (
            f"{p} has {want.algorithm} {got[:16]}..., the manifest says {want.digest[:16]}...; "
            "the file is corrupted"
        )
    return None


def verify_checkpoint(
    path: "str | os.PathLike[str]", *, hmac_key: bytes | None = None
) -> CheckpointManifest:
    """Check the manifest (and its keyed digest with ``hmac_key``), every file's size and
    checksum (this process alone; BLAKE3, or SHA-256 where the manifest says so), and that ``.metadata`` is plain DCP metadata (its
    opcodes read; nothing is unpickled)."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    if hmac_key is not None:
        check_keyed_digest(manifest, hmac_key, source=str(folder))
    _verify_files(folder, manifest, slice(None))
    if (folder / METADATA).is_file():  # always listed: a missing one fails the line above
        check_metadata_file(folder / METADATA)
    return manifest
