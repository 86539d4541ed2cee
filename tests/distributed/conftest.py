"""Session fixtures shared by several modules of this folder (one definition each)."""

from pathlib import Path

import pytest

from tests.distributed.launches import DistRun, launch_dtensor, launch_megatron


@pytest.fixture(scope="session")
def dtensor_dist_run(tmp_path_factory: pytest.TempPathFactory) -> DistRun:
    """The one 8-rank DTensor launch (``test_dtensor_dist``, ``test_fsdp2_placements``)."""
    return launch_dtensor(tmp_path_factory.mktemp("dtensor_dist"))


@pytest.fixture(scope="session")
def megatron_ground_truth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of per-case, per-rank JSON records written by one torchrun launch.

    Records go to a temporary directory of the session (pytest's ``tmp_path_factory``;
    ``--basetemp DIR`` keeps it where you want it), never one shared between sessions.
    Read ``<dir>/<case>/rank<r>.json`` and ``<dir>/manifest.json``.
    """
    return launch_megatron(tmp_path_factory.mktemp("megatron_cpu_ground_truth"))
