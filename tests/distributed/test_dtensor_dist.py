"""Real DTensor under torchrun (8 gloo ranks on CPU) against our shard/unshard/Mesh.

One launch of ``dtensor_worker.py`` runs every section (this file's and
``test_fsdp2_placements.py``'s); the tests below read its per-rank JSON summaries.
"""

import json
from typing import Any

import pytest

from tests.distributed.launches import DTENSOR_WORLD as WORLD
from tests.distributed.launches import DistRun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("dtensor_dist")]


def _show(failures: list[dict[str, Any]], n: int = 8) -> str:
    return "\n".join(json.dumps(f, default=str)[:1500] for f in failures[:n])


def test_every_rank_finished(dtensor_dist_run: DistRun) -> None:
    run = dtensor_dist_run
    crashes = run.failures("crash") + run.failures("setup")
    assert not crashes, _show(crashes)
    assert len(run.summaries) == WORLD, run.result.report()
    assert run.result.ok, run.result.report()


def test_distribute_tensor_matches_shard(dtensor_dist_run: DistRun) -> None:
    run = dtensor_dist_run
    assert not run.failures("dtensor"), _show(run.failures("dtensor"))
    # Every rank checked every case; both of distribute_tensor's paths ran.
    assert min(run.counts("dtensor.cases")) >= 200
    assert min(run.counts("dtensor.scatter")) >= 50
    assert min(run.counts("dtensor.local_split")) >= 50
    assert min(run.counts("dtensor.full_tensor")) >= 80


def test_from_local_full_tensor_matches_unshard(dtensor_dist_run: DistRun) -> None:
    run = dtensor_dist_run
    assert not run.failures("from_local"), _show(run.failures("from_local"))
    assert min(run.counts("from_local.cases")) >= 200
    assert min(run.counts("from_local.partial")) >= 80


def test_mesh_groups_match_device_mesh(dtensor_dist_run: DistRun) -> None:
    run = dtensor_dist_run
    assert not run.failures("groups"), _show(run.failures("groups"))
    # Meshes (8,), (2, 4), (4, 2), (2, 2, 2): 1 + 2 + 2 + 3 axes on every rank.
    assert run.counts("groups.checks") == [8] * WORLD


def test_dtensor_gather_known_divergence(dtensor_dist_run: DistRun) -> None:
    """On real gloo too, DTensor's ``full_tensor`` does not invert its own split of
    ``(SS(0,1), SS(0,2))``; our ``unshard`` does. When torch fixes it, this fails:
    then widen ``tests.torch_placements.gather_safe``."""
    run = dtensor_dist_run
    assert not run.failures("known_divergence"), _show(run.failures("known_divergence"))
    obs = [o for o in run.observations() if "full_tensor_equals_input" in o]
    assert len(obs) == WORLD
    assert all(o["unshard_equals_input"] for o in obs)
    assert not any(o["full_tensor_equals_input"] for o in obs), "torch now inverts it"
