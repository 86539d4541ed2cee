"""What a CLI error line may not say: the library's Python spellings of the command's
flags (``context_len=0``, ``top=0``, ``pass verify``) or a temporary path the user never
gave (``/sys/.areal_out.y2uw686k``).

:func:`cli_term_problems` is the check; the autouse fixture of ``tests/conftest.py``
applies it to every error line ``areal-fn`` prints in any test (each CLI error path a test
reaches), and the CLI fuzz test to the lines its random command lines reach.
"""

import argparse
import functools
import os
import re
from collections.abc import Sequence


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    """The ``dest`` of every optional flag of ``parser`` and its subcommands."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _dests(sub)
        elif action.option_strings and action.dest not in ("help", "version"):
            out.add(action.dest)
    return out


@functools.cache
def _python_spellings() -> re.Pattern[str]:
    """``context_len=`` / ``context_len`` (a flag's dest as a Python keyword) and ``pass
    verify`` (a flag named without its dashes)."""
    from areal_fn.cli import build_parser

    dests = sorted(_dests(build_parser()) - {"global_json"}, key=len, reverse=True)
    words = "|".join(re.escape(d) for d in dests)
    snake = "|".join(re.escape(d) for d in dests if "_" in d)
    return re.compile(rf"(?<![-\w])(?:{words})=|(?<![-\w])(?:{snake})\b|\bpass (?:{words})\b(?!-)")


#: A path in a message: at least one slash, made of path characters.
_PATH = re.compile(r"[\w~.+-]*(?:/[\w~.+-]*)+")


def _under(path: str, roots: Sequence[str]) -> bool:
    """``path`` is one of ``roots`` or inside one (both made absolute)."""
    where = os.path.abspath(path)
    return any(
        where == (r := os.path.abspath(root)) or where.startswith(r.rstrip("/") + "/")
        for root in roots
    )


def cli_term_problems(line: str, argv: Sequence[str]) -> list[str]:
    """Why ``line`` (an ``areal-fn: error:`` line for command line ``argv``) speaks in
    the wrong terms; empty when it does not. A hidden name (``.x``) in a path is the
    user's own only inside a path the command line gave (a checkpoint's ``.metadata``);
    elsewhere it is a temporary name the user never saw."""
    problems = [f"Python spelling {m.group()!r}" for m in _python_spellings().finditer(line)]
    given = [w for w in argv if w and not w.startswith("-")]
    for path in _PATH.findall(line):
        parts = path.split("/")
        for i, part in enumerate(parts):
            inside = _under("/".join(parts[:i]) or "/", given)
            if part.startswith(".") and part not in (".", "..") and not inside:
                problems.append(f"path {path!r} has {part!r}, which the command line never gave")
    return problems
