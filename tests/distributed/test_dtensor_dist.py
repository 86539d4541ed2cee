"""Real DTensor under torchrun (8 gloo ranks on CPU) against our shard/unshard/Mesh.

One launch of ``dtensor_worker.py`` runs every section (this file's and
``test_fsdp2_placements.py``'s); the tests below read its per-rank JSON summaries.
"""

import functools
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from areal_fn.runtime.launch import LaunchResult, run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("dtensor_dist")]

WORKER = Path(__file__).with_name("dtensor_worker.py")
REPO = Path(__file__).resolve().parents[2]
WORLD = 8


@attrs.frozen(kw_only=True)
class DistRun:
    """The launch and every rank's summary (``counts``, ``failures``, ``observations``)."""

    result: LaunchResult
    summaries: tuple[dict[str, Any], ...]

    def failures(self, prefix: str) -> list[dict[str, Any]]:
        return [
            f
            for s in self.summaries
            for f in s["failures"]
            if f["section"] == prefix or f["section"].startswith(prefix + ".")
        ]

    def counts(self, key: str) -> list[int]:
        """``key``'s count on every rank."""
        return [s["counts"].get(key, 0) for s in self.summaries]

    def observations(self) -> list[dict[str, Any]]:
        return [o for s in self.summaries for o in s["observations"]]


@functools.cache
def _launch(out: Path) -> DistRun:
    """The one launch per session (the fixture is imported by several test modules)."""
    result = run_torchrun(
        WORKER, ["--out", str(out)], nproc=WORLD, timeout_s=600, cwd=REPO, check=False
    )
    summaries = tuple(
        json.loads(p.read_text()) for r in range(WORLD) if (p := out / f"rank{r}.json").exists()
    )
    return DistRun(result=result, summaries=summaries)


@pytest.fixture(scope="session")
def dtensor_dist_run(tmp_path_factory: pytest.TempPathFactory) -> DistRun:
    return _launch(tmp_path_factory.mktemp("dtensor_dist"))


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
