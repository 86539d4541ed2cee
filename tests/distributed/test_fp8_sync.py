"""Weight sync into an FP8 deployment (``fp8_sync_worker.py``: one 4-rank gloo launch):
the destination's FP8 weights and scales equal, bitwise, the quantisation of the whole
canonical tensors, and the bytes sent equal the bound of the FP8 layouts."""

import json
from pathlib import Path
from typing import Any

import pytest

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist]

WORKER = Path(__file__).with_name("fp8_sync_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fp8_sync") / "fp8_sync.json"
    run_torchrun(WORKER, ["--out", str(out)], nproc=4, timeout_s=300, cwd=REPO)
    return list(json.loads(out.read_text()))


def test_destinations_hold_the_whole_tensors_quantisation(record: list[dict[str, Any]]) -> None:
    assert [r["case"] for r in record] == [
        "fsdp_d2_aligned",
        "fsdp_d2_cut128",
        "megatron_t2_cut128",
    ]
    for r in record:
        assert r["mismatched"] == [], r
        # 2 layers x 7 linear weights, each with a scale, on both inference ranks
        assert r["scales"] == 2 * 2 * 7, r
    # the aligned case exchanges no amax; the 128x128 cases cut blocks
    assert [r["cut_blocks"] > 0 for r in record] == [False, True, True]


def test_the_bytes_sent_are_the_fp8_bound(record: list[dict[str, Any]]) -> None:
    for r in record:
        assert r["sent"] == r["fp8_bound"] == r["plan_bytes"], r
        # about half of bf16's: one byte per quantised value plus the scales
        assert 0.5 < r["sent"] / r["bf16_bound"] < 0.6, r
