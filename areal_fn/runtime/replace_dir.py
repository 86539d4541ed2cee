"""Put a finished directory in place of another without a moment where neither exists whole.

Writers build a checkpoint or a converted model in a sibling temporary directory and
then call :func:`replace_dir`. An existing destination is renamed aside first (one
``rename`` on the same file system), the new directory is renamed into place, and only
then is the old one deleted. A failure of the second rename puts the old directory
back; a crash between the two renames leaves it whole beside the destination, as
``.<name>.replaced-<hex>``.
"""

import os
import secrets
import shutil
from pathlib import Path


def replace_dir(new: Path, dest: Path) -> None:
    """Rename directory ``new`` to ``dest``, replacing what ``dest`` held (see the module)."""
    if not dest.exists() and not dest.is_symlink():
        os.replace(new, dest)
        return
    aside = dest.with_name(f".{dest.name}.replaced-{secrets.token_hex(4)}")
    os.replace(dest, aside)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(aside, dest)
        raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
