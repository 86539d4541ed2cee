"""Megatron-Core's own checkpoints: imported into canonical space, exported for it to load.

One torchrun launch (2 ranks, gloo, CPU) of ``checkpoint_worker_mcore.py``: Megatron-Core
saves a tp=2 ``GPTModel`` with ``dist_checkpointing`` (``torch_dist``), we import it
(bitwise equal to the weights it held), export the canonical weights, and Megatron-Core
loads the export into the model under pp=2 (bitwise equal to ``to_megatron``).
"""

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs megatron-core", allow_module_level=True)

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("checkpoint_mcore")]

WORKER = Path(__file__).with_name("checkpoint_worker_mcore.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("checkpoint_mcore")
    run_torchrun(WORKER, ["--out", str(out)], nproc=2, timeout_s=600, cwd=REPO)
    return [json.loads((out / f"rank{r}.json").read_text())["checks"] for r in range(2)]


def test_import_of_a_megatron_tp2_checkpoint_is_bitwise(checks):
    assert checks[0].get("import") == "", checks[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_megatron_loads_our_export_under_pp2_bitwise(checks, rank):
    assert checks[rank].get("megatron loads the export under pp=2") == "", checks[rank]
