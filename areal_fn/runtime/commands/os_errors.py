"""OS errors of the ``areal-fn`` commands, said in the user's terms.

A command that writes a directory writes it beside the destination first, under a
hidden temporary name (``.out.k2x9``, ``.tmp-out``), and swaps it in when complete
(:mod:`areal_fn.runtime.replace_dir`). An OS error raised while doing so names that
temporary path, which the user never gave: :func:`os_error_message` names the
destination the user gave instead, with the flag (or argument) that gave it.
"""

import errno
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["os_error_message", "prepare_png_dir"]

#: What to do about an OS error, by its errno.
_REMEDY = {
    errno.EACCES: "choose a place you may write, or fix its permissions",
    errno.EPERM: "choose a place you may write, or fix its permissions",
    errno.EROFS: "it is on a read-only file system: choose another place",
    errno.ENOSPC: "free some space there, or choose another place",
    errno.EDQUOT: "free some space there, or choose another place",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.EEXIST: "a file of that name is in the way: choose another path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ENOENT: "a part of the path does not exist, or cannot be made there: check the path",
}


def _scratch_of(path: Path, outputs: Sequence[tuple[str, Path]]) -> tuple[str, Path] | None:
    """The output (``(flag, path)``) whose hidden temporary sibling ``path`` is or is
    inside, None when ``path`` is no such temporary path."""
    for flag, out in outputs:
        out = Path(os.path.abspath(out))
        try:
            rel = Path(os.path.abspath(path)).relative_to(out.parent)
        except ValueError:
            continue
        head = rel.parts[0] if rel.parts else ""
        if head.startswith(".") and out.name in head and head != out.name:
            return flag, out
    return None


def os_error_message(e: OSError, outputs: Sequence[tuple[str, Path]]) -> str:
    """One line for ``e``: the path the user gave (one of ``outputs``, ``(flag, path)``,
    when ``e`` names a temporary path of that output), the system's reason and a remedy.
    """
    reason = e.strerror or str(e)
    remedy = _REMEDY.get(e.errno or 0)
    tail = f"; {remedy}" if remedy else ""
    if e.filename is None:
        return f"{reason}{tail}"
    path = Path(os.fsdecode(e.filename))
    scratch = _scratch_of(path, outputs)
    if scratch is not None:
        flag, out = scratch
        return f"{flag} {out}: cannot write it: {reason}{tail}"
    where = Path(os.path.abspath(path))
    for flag, out in outputs:
        if where == Path(os.path.abspath(out)):
            return f"{flag} {out}: {reason}{tail}"
        if where in Path(os.path.abspath(out)).parents:
            return f"{flag} {out}: cannot write it ({path}: {reason}){tail}"
    return f"{path}: {reason}{tail}"


def prepare_png_dir(text: str) -> Path:
    """``--png DIR``, created (with its parents) and checked writable before the plan
    prints anything, so that a bad target fails at once, not half-way through."""
    import tempfile

    out = Path(text)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        from areal_fn.errors import SpecError

        reason = e.strerror or str(e)
        remedy = _REMEDY.get(e.errno or 0, "choose a directory you may write")
        raise SpecError(f"--png {text}: cannot write pictures there: {reason}; {remedy}") from None
    return out
