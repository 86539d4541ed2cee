"""Ranks quantising their shards to block FP8 by the plan, over gloo, write bitwise the
slices of the whole tensor's quantisation (``fp8_worker.py``: one 4-rank launch)."""

import json
from pathlib import Path

import pytest

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist]

WORKER = Path(__file__).with_name("fp8_worker.py")
REPO = Path(__file__).resolve().parents[2]


def test_ranks_quantise_their_shards_as_the_whole(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    run_torchrun(WORKER, ["--out", str(out)], nproc=4, timeout_s=300, cwd=REPO)
    record = json.loads(out.read_text())
    assert [r["cut"] for r in record] == [6, 2, 0, 3]
    assert all(all(r["same"]) and len(r["same"]) == 4 for r in record), record
