"""Python blocks marked ``<!-- runs -->`` in docs/*.md run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- runs -->\n```python\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    out = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for i, code in enumerate(BLOCK.findall(doc.read_text())):
            out.append((f"{doc.name}#{i}", code))
    return out


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[b[0] for b in blocks()])
def test_doc_example_runs(where, code, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(code, where, "exec"), {"__name__": "doc_example"})
