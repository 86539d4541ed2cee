"""Put a finished directory in place of another without a moment where neither exists whole.

Writers build a checkpoint or a converted model in a sibling temporary directory and
then call :func:`replace_dir`. Where the system can (Linux ``renameat2`` with
``RENAME_EXCHANGE``), the two directories swap names in one step, so the destination
always holds the old directory or the new one, complete; the old one, now under the
temporary name, is then deleted. Elsewhere an existing destination is renamed aside
first (one ``rename`` on the same file system), the new directory is renamed into
place, and only then is the old one deleted; a failure of the second rename puts the
old directory back, and a crash between the two renames leaves it whole beside the
destination, as ``.<name>.replaced-<hex>``.

:func:`check_overwrite` is the one meaning of ``overwrite`` for every writer of a
directory: an existing destination is refused without it; with it, the destination
is replaced whole, so it may hold only files of the kind the writer writes (what the
new output holds and stale files of the same format, e.g. older shards or rank
files); any other file is refused by name before anything is written.
"""

import ctypes
import errno
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from areal_fn.errors import SpecError

__all__ = ["check_overwrite", "new_output_dir", "replace_dir"]

#: ``renameat2``'s flag swapping two paths, and the "current directory" descriptor.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: How many foreign files a refusal names before it counts the rest.
_NAMED = 8


def _renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2`` (Linux, glibc >= 2.28), None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn: Callable[..., int] | None = getattr(libc, "renameat2", None)
    return fn


def _exchange(new: Path, dest: Path) -> bool:
    """Swap the names of directories ``new`` and ``dest`` in one step; False where the
    system or the file system cannot (nothing changed then)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(dest), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dest))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def new_output_dir(dest: Path) -> Path:
    """A new empty directory beside ``dest`` to write its replacement into, with the
    permissions a directory made by ``mkdir`` gets under the process's umask (a
    temporary directory is made owner-only, and ``dest`` would keep that mode)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def replace_dir(new: Path, dest: Path) -> None:
    """Rename directory ``new`` to ``dest``, replacing what ``dest`` held (see the module)."""
    if not dest.exists() and not dest.is_symlink():
        os.replace(new, dest)
        return
    if dest.is_dir() and not dest.is_symlink() and _exchange(new, dest):
        _remove(new)  # the old directory, under the temporary name
        return
    aside = dest.with_name(f".{dest.name}.replaced-{secrets.token_hex(4)}")
    os.replace(dest, aside)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(aside, dest)
        raise
    _remove(aside)


def _foreign(folder: Path, owned: Callable[[str], bool], subdirs: Collection[str]) -> Iterator[str]:
    """The entries of ``folder`` neither ``owned`` (a file) nor in ``subdirs`` (a
    directory whose own entries are judged by ``owned`` with ``dir/name``), by name."""
    for p in folder.iterdir():
        is_dir = p.is_dir() and not p.is_symlink()
        if p.is_file() and not p.is_symlink() and owned(p.name):
            continue
        if is_dir and p.name in subdirs:
            yield from (f"{p.name}/{n}" for n in _foreign(p, _within(p.name, owned), ()))
            continue
        yield p.name + ("/" if is_dir else "")


def _within(subdir: str, owned: Callable[[str], bool]) -> Callable[[str], bool]:
    """``owned`` of a name in ``subdir``, judged by ``subdir/name``."""
    return lambda name: owned(f"{subdir}/{name}")


def check_overwrite(
    dest: Path,
    *,
    overwrite: bool,
    owned: Callable[[str], bool],
    kind: str,
    error: type[SpecError],
    subdirs: Collection[str] = (),
) -> None:
    """Refuse (``error``, one line) to write a ``kind`` (``HF checkpoint``, ``rank
    files``) at ``dest`` when ``dest`` exists and ``overwrite`` is False, is not a
    directory, or holds an entry ``owned`` (called with each name in ``dest``) does not
    claim: the files named, with the remedy. ``subdirs`` are directories the new output
    holds: in one of them, ``owned`` judges each file by ``dir/name``. Nothing is read
    or written otherwise."""
    if not dest.exists() and not dest.is_symlink():
        return
    if not overwrite:
        raise error(f"{dest} already exists; pass overwrite=True or choose another directory")
    if not dest.is_dir():
        raise error(f"{dest} exists and is not a directory; remove it or choose another path")
    foreign = sorted(_foreign(dest, owned, subdirs))
    if foreign:
        named = ", ".join(foreign[:_NAMED])
        more = f" and {len(foreign) - _NAMED} more" if len(foreign) > _NAMED else ""
        raise error(
            f"{dest} holds {len(foreign)} entr{'ies' if len(foreign) > 1 else 'y'} the new "
            f"{kind} would not replace: {named}{more}; overwrite=True replaces the directory "
            f"whole and would delete them: move them out of {dest}, or choose another directory"
        )
