"""The docs' examples run as written, from any directory.

Python blocks marked ``<!-- runs -->`` in docs/*.md run on their own (no names shared
between blocks) with a fresh empty temporary directory as the working directory, so a
block that reads a path relative to this repository fails here as it would for a user
elsewhere. Every other python block must say why it does not run (``<!-- not run:
REASON -->``, with the reason in the text too, e.g. that it needs torchrun).

The pages in ``IN_ORDER`` are followed as a user follows them: every ``bash`` and
``python`` block runs, in page order, in one fresh empty directory, so a block may read
the files an earlier block wrote and nothing else. Bash blocks run under ``bash -euo
pipefail`` with the virtual environment's ``bin`` first on ``PATH`` (the installed
``areal-fn``); python blocks are executed in this process (each with its own names, our
warnings errors). A block that cannot run carries ``<!-- not run: REASON -->``. A
``json`` block shows what the bash block right before it prints: every key shown must
be printed with the value shown (the printed document may hold keys added since). ``text``
and unlabelled blocks are output shown, not run. An image a page shows
(``pictures/x.png``) must be the file its blocks wrote under that path, byte for byte.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<marker><!-- [^\n]*-->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)
BLOCK = re.compile(
    r"^(?P<marker><!-- [^\n]*-->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M
)
RUNS = "<!-- runs -->\n"
NOT_RUN = re.compile(r"<!-- not run: \S.*-->\n")
#: Every block of these pages runs, in page order, in one directory.
IN_ORDER = ("howto.md", "cli.md")
#: On a page of IN_ORDER: the blocks that run, and those that show output (json is checked).
COMMANDS = ("bash", "python")
SHOWN = ("json", "text", "")
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<path>[^)\s:]+)\)")
OUR_WARNING = re.compile(r"areal_fn/\S+\.py:\d+: \w*Warning")


def python_blocks() -> list[tuple[str, str | None, str]]:
    """(``page#index``, the marker line before the block or None, the code)."""
    out = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name in IN_ORDER:
            continue
        for i, m in enumerate(FENCE.finditer(doc.read_text())):
            out.append((f"{doc.name}#{i}", m["marker"], m["code"]))
    return out


def blocks() -> list[tuple[str, str]]:
    return [(where, code) for where, marker, code in python_blocks() if marker == RUNS]


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[b[0] for b in blocks()])
def test_doc_example_runs(where, code, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "doc_example"})


def test_every_python_block_runs_or_says_why_not():
    unlabelled = [
        where
        for where, marker, _ in python_blocks()
        if marker != RUNS and not (marker and NOT_RUN.fullmatch(marker))
    ]
    assert unlabelled == [], (
        f"python blocks neither marked <!-- runs --> nor <!-- not run: ... -->: {unlabelled}"
    )


class Block(NamedTuple):
    """A fenced block of a page: ``where`` is ``page#index, line N``."""

    where: str
    lang: str
    marker: str | None
    code: str


def page_blocks(page: str) -> list[Block]:
    text = (ROOT / "docs" / page).read_text()
    return [
        Block(
            f"{page}#{i}, line {text.count(chr(10), 0, m.start('code'))}",
            m["lang"],
            m["marker"],
            m["code"],
        )
        for i, m in enumerate(BLOCK.finditer(text))
    ]


def json_differences(shown: object, printed: object, at: str = "") -> list[str]:
    """Where ``printed`` does not hold ``shown``: a key shown must be printed with the value
    shown, a list must have the same length; the printed document may hold more keys (a
    schema version only adds keys)."""
    if isinstance(shown, dict) and isinstance(printed, dict):
        return [
            d
            for k, v in shown.items()
            for d in (
                json_differences(v, printed[k], f"{at}.{k}")
                if k in printed
                else [f"{at}.{k} not printed"]
            )
        ]
    if isinstance(shown, list) and isinstance(printed, list) and len(shown) == len(printed):
        return [
            d
            for i, (a, b) in enumerate(zip(shown, printed))
            for d in json_differences(a, b, f"{at}[{i}]")
        ]
    if type(shown) is type(printed) and shown == printed:
        return []
    return [f"{at or 'the document'}: shown {shown!r}, printed {printed!r}"]


def _run_bash(block: Block, cwd: pathlib.Path) -> str:
    """The block's stdout; fails naming the block, with its stderr, unless it exits 0."""
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env = {**os.environ, "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")])}
    env.pop("AREAL_FN_CHECKPOINT_KEY", None)
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{block.where}: exit status {proc.returncode}\n{block.code}\nstderr:\n{proc.stderr}"
        )
    warned = OUR_WARNING.findall(proc.stderr)
    assert warned == [], f"{block.where}: warnings from areal_fn:\n{block.code}\n{proc.stderr}"
    return proc.stdout


def _run_python(block: Block) -> None:
    try:
        exec(compile(block.code, block.where, "exec"), {"__name__": "doc_example"})
    except Exception as e:
        e.add_note(f"{block.where}: this block failed, run in page order:\n{block.code}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("page", IN_ORDER)
def test_page_runs_in_order(page, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AREAL_FN_CHECKPOINT_KEY", raising=False)
    stdout: str | None = None  # of the block just run, when it was bash
    for block in page_blocks(page):
        if block.marker is not None:
            assert NOT_RUN.fullmatch(block.marker), (
                f"{block.where}: every block of {page} runs in page order; the only marker is "
                f"<!-- not run: REASON -->, not {block.marker.strip()}"
            )
            assert block.lang in COMMANDS, f"{block.where}: a {block.lang!r} block is not run"
            stdout = None
            continue
        assert block.lang in COMMANDS + SHOWN, f"{block.where}: no way to run {block.lang!r}"
        printed, stdout = stdout, None
        if block.lang == "bash":
            stdout = _run_bash(block, tmp_path)
        elif block.lang == "python":
            _run_python(block)
        elif block.lang == "json":
            assert printed is not None, f"{block.where}: a json block follows the bash it shows"
            differ = json_differences(json.loads(block.code), json.loads(printed))
            assert differ == [], f"{block.where}: {differ}; the command before it prints\n{printed}"
    for path in IMAGE.findall((ROOT / "docs" / page).read_text()):
        assert (tmp_path / path).is_file(), f"{page} shows {path}, which none of its blocks writes"
        assert (tmp_path / path).read_bytes() == (ROOT / "docs" / path).read_bytes(), (
            f"{page} shows docs/{path}, which is not what its command writes; run that "
            f"command in docs/ to write it again"
        )
