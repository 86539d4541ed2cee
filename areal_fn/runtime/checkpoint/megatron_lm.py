"""The directory Megatron-LM's ``--load DIR`` reads a ``torch_dist`` checkpoint from.

Megatron-LM (``megatron/training/checkpointing.py``) reads the tracker
``DIR/latest_checkpointed_iteration.txt``: an iteration ``N`` names
``DIR/iter_{N:07d}/``, the word ``release`` names ``DIR/release/``; that directory
holds the Megatron-Core dist checkpoint. Megatron-LM loads a release checkpoint at
iteration 0 and reads neither optimizer, RNG nor rerun state from it, so ``--load DIR``
needs no ``--finetune``, ``--no-load-optim`` or ``--no-load-rng``; its
``read_metadata`` has read ``release`` since 2019, while a tracker of ``0`` was refused
before November 2025.
:func:`convert_to_torch_dist
<areal_fn.runtime.checkpoint.megatron_convert.convert_to_torch_dist>` writes a release
checkpoint (:func:`make_release`); :func:`dist_checkpoint_dir` finds the checkpoint in
such a directory or in a flat one (a Megatron-Core dist checkpoint itself).
"""

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from areal_fn.errors import CheckpointError
from areal_fn.runtime.checkpoint.files import _fsync_dir, _write_text_atomic

__all__ = [
    "COMMON_STATE",
    "RELEASE",
    "TRACKER",
    "dist_checkpoint_dir",
    "is_megatron_lm_dir",
    "make_release",
]

#: Megatron-LM's tracker file: the iteration to load, or ``release``
TRACKER = "latest_checkpointed_iteration.txt"
#: the directory of a release checkpoint (what a tracker of ``release`` names)
RELEASE = "release"
#: the release checkpoint's common state (``common.pt``): Megatron-LM's
#: ``load_checkpoint`` reads ``checkpoint_version`` (absent, it reads 0, which marks
#: fused QKV weights of the pre-2.0 order); 3.0 is what Megatron-LM writes
COMMON_STATE: Mapping[str, object] = {"checkpoint_version": 3.0}

_ITERATION = re.compile(r"\d+")


def is_megatron_lm_dir(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` holds Megatron-LM's tracker file."""
    return (Path(path) / TRACKER).is_file()


def dist_checkpoint_dir(path: "str | os.PathLike[str]") -> Path:
    """The Megatron-Core dist checkpoint in ``path``: ``path`` itself when it holds
    ``metadata.json`` or no tracker, else the directory its tracker names (which must
    hold ``metadata.json``). ``CheckpointError`` for a tracker that is neither an
    iteration nor ``release``, or names a directory without a checkpoint."""
    root = Path(path)
    if (root / "metadata.json").is_file() or not is_megatron_lm_dir(root):
        return root
    tracker = root / TRACKER
    text = tracker.read_text(errors="replace").strip()
    if text == RELEASE:
        folder = root / RELEASE
    elif _ITERATION.fullmatch(text):
        folder = root / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(
            f"{tracker} holds {text[:40]!r}; Megatron-LM's tracker holds the iteration to load "
            f"or {RELEASE!r}: write one of them, or pass the checkpoint directory itself"
        )
    if not (folder / "metadata.json").is_file():
        raise CheckpointError(
            f"{tracker} names {folder}, which holds no Megatron-Core dist checkpoint (no "
            "metadata.json); point the tracker at a checkpoint directory beside it, or pass "
            "the checkpoint directory itself"
        )
    return folder


def make_release(root: Path) -> None:
    """Make ``root``, whose ``release/`` holds a dist checkpoint, what Megatron-LM's
    ``--load root`` reads: that checkpoint's common state becomes :data:`COMMON_STATE`
    and the tracker says ``release``. Both files are fsynced."""
    common = root / RELEASE / "common.pt"
    tmp = common.with_name(common.name + ".tmp")
    torch.save(dict(COMMON_STATE), tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, common)
    _fsync_dir(common.parent)
    _write_text_atomic(root / TRACKER, RELEASE)
    _fsync_dir(root)
