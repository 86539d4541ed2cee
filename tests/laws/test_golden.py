"""Golden layouts: re-render every case of ``tools.golden.CASES`` and diff it.

A mismatch prints a unified diff (first lines) and the command that regenerates the
files; regenerate only when the layout change is intended, and review the diff.
"""

import difflib
from pathlib import Path

import pytest

from areal_fn.errors import SpecError
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.strategy.allocation import ParallelDims
from tools.golden import CASES, REGENERATE, golden_ranks, render_case, render_layout

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "specs" / "models"
GOLDEN = ROOT / "specs" / "golden"
MAX_DIFF_LINES = 80


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.stem)
def test_layout_matches_its_golden_file(case):
    path = GOLDEN / f"{case.stem}.txt"
    assert path.exists(), f"{path} is missing; generate it with: {REGENERATE}"
    want = path.read_text(encoding="utf-8")
    got = render_case(case, MODELS)
    if got != want:
        diff = list(
            difflib.unified_diff(
                want.splitlines(),
                got.splitlines(),
                fromfile=f"{path.relative_to(ROOT)} (golden)",
                tofile="rendered now",
                lineterm="",
                n=2,
            )
        )
        shown = "\n".join(diff[:MAX_DIFF_LINES])
        more = (
            f"\n... {len(diff) - MAX_DIFF_LINES} more diff lines"
            if len(diff) > MAX_DIFF_LINES
            else ""
        )
        pytest.fail(
            f"{case.model} under {case.allocation} no longer renders as {path.name}:\n"
            f"{shown}{more}\nIf the change is intended, regenerate with: {REGENERATE}"
        )


def test_golden_ranks_are_first_middle_and_last():
    assert golden_ranks(1) == (0,)
    assert golden_ranks(2) == (0, 1)
    assert golden_ranks(4) == (0, 2, 3)
    assert golden_ranks(8) == (0, 4, 7)


def test_render_marks_padding_and_summarises_every_rank():
    model = model_from_hf_config(MODELS / "Qwen3-8B.json")  # vocab 151936: padded under tp=2
    layout = megatron_layout(model, ParallelDims(dp=1, tp=2, pp=2))
    text = render_layout(layout, (3,))
    assert text == render_layout(layout, (3,))
    for r in range(4):
        assert f"\nrank {r}: " in text
    assert "\nrank 3\n" in text and "\nrank 0\n" not in text
    assert "    <padding> -> [75904:76032,0:4096]" in text
    with pytest.raises(SpecError, match="rank 4 is outside this megatron layout of 4 ranks"):
        render_layout(layout, (4,))
