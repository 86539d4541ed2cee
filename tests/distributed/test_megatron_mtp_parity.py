"""A DeepSeek-V3 multi-token-prediction layer converted to Megatron-Core, against its
definition written with transformers' modules (``mtp_worker.py``: one ``torchrun
--nproc-per-node 4`` launch, gloo; at t1 = d4, t2 and e2).

``to_megatron`` of a checkpoint with an MTP layer loads every parameter of a real
``GPTModel`` with Megatron-Core's MTP block (the MTP layer's own embedding and head are
tied to the main ones); the MTP layer's logits and the main logits match the reference
to fp32 precision, while the control (``eh_proj``'s input halves swapped) is far off; and
``to_hf`` of the loaded parameters gives back every canonical tensor, the MTP copies of
the embedding and head included, bitwise.
"""

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs megatron-core and transformers", allow_module_level=True)

from areal_fn.runtime.launch import run_torchrun
from tests.distributed.mtp_worker import STRATEGIES

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("megatron_mtp")]

WORKER = Path(__file__).with_name("mtp_worker.py")
REPO = Path(__file__).resolve().parents[2]
#: as for the main model (test_conversion_parity.py); observed <= 6.6e-7
LOGITS_ATOL = 1.5e-6


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("megatron_mtp")
    run_torchrun(WORKER, ["--out", str(out)], nproc=4, timeout_s=900, cwd=REPO)
    return json.loads((out / "report.json").read_text())


def test_every_strategy_ran_and_loaded_the_mtp_block(report: Any) -> None:
    assert [c["case"] for c in report["cases"]] == list(STRATEGIES)
    for case in report["cases"]:
        assert case["mtp_parameters"] > 0, case
        assert case["output_layer_calls"] == 2, case  # the MTP layer's logits, then the main


def test_mtp_and_main_logits_match_the_reference(report: Any) -> None:
    for case in report["cases"]:
        assert case["mtp_max_abs_diff"] < LOGITS_ATOL, case
        assert case["main_max_abs_diff"] < LOGITS_ATOL, case
        # the comparison can fail: the MTP logits are not the main ones, nor the control's
        assert case["mtp_vs_main_max_abs"] > 0.1, case
        assert case["mtp_vs_swapped_max_abs"] > 0.1, case


def test_to_hf_gives_back_every_canonical_tensor(report: Any) -> None:
    for case in report["cases"]:
        assert case["roundtrip_unequal"] == [], case
        assert case["roundtrip_tensors"] > 100, case
