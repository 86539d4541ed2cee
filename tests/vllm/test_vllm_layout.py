"""``vllm_layout`` against real vLLM workers: every rank's parameters, as vLLM's own
loaders fill them from the same HF checkpoint (names, shapes, every element), at TP1
and TP2, with vocabulary padding, replicated KV heads (tp > KV heads), tied and untied
heads, q/k/v biases, q/k norms and stacked routed experts (qwen3_moe). One engine per case, each in a process of its own
(``layout_worker.py``)."""

import json

import pytest

from tests.vllm.cases import CASES
from tests.vllm.conftest import run_module

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("vllm")]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("vllm_layout")
    got = {}
    for name in CASES:
        path = out / f"{name}.json"
        log = out / f"{name}.log"
        rc = run_module(
            "tests.vllm.layout_worker", ["--case", name, "--out", str(path)], timeout_s=420, log=log
        )
        assert rc == 0 and path.exists(), f"{name}: exit {rc}\n{log.read_text()[-4000:]}"
        got[name] = json.loads(path.read_text())
    return got


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_holds_what_the_layout_says(reports: dict[str, dict], name: str) -> None:
    report = reports[name]
    assert len(report["ranks"]) == CASES[name].tp
    for r, rank in enumerate(report["ranks"]):
        assert rank["vllm_names"] == rank["our_names"], f"rank {r}"
        assert rank["shape_mismatch"] == [], f"rank {r}"
        assert rank["value_mismatch"] == [], f"rank {r}"
        assert rank["compared"] == len(rank["our_names"]) > 0
        assert rank["elements"] > 0


def test_an_offline_engine_serves_what_a_trainer_sent(reports: dict[str, dict]) -> None:
    """llama at TP1: a one-rank trainer in the engine's process updates a ``vllm.LLM``
    (``LlmDeployment``) in both modes: the bytes equal each mode's bound, vLLM's
    log-probs the trainer's."""
    sync = reports["llama-t1"]["sync"]
    for version, mode in enumerate(("sharded", "full"), start=1):
        got = sync[mode]
        assert got["weight_version"] == str(version)
        assert got["bytes_sent"] == got["lower_bound"] > 0
        assert got["max_diff"] <= 2e-5, (mode, got)
