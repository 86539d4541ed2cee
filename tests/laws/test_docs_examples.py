"""Python blocks marked ``<!-- runs -->`` in docs/*.md run as written, from any directory.

Each block runs on its own (no names shared between blocks) with a fresh empty
temporary directory as the working directory, so a block that reads a path relative
to this repository fails here as it would for a user elsewhere. Every other python
block must say why it does not run (``<!-- not run: REASON -->``, with the reason in
the text too, e.g. that it needs torchrun); every block of the how-to runs.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<marker><!-- [^\n]*-->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)
RUNS = "<!-- runs -->\n"
NOT_RUN = re.compile(r"<!-- not run: \S.*-->\n")
#: Every python block of these pages runs.
ALL_RUN = ("howto.md",)


def python_blocks() -> list[tuple[str, str | None, str]]:
    """(``page#index``, the marker line before the block or None, the code)."""
    out = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
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
    not_running = [
        where
        for where, marker, _ in python_blocks()
        if where.split("#")[0] in ALL_RUN and marker != RUNS
    ]
    assert not_running == [], f"every how-to block must run: {not_running}"
