"""A saving process killed with SIGKILL at any moment leaves the previous checkpoint intact.

Two launches of ``checkpoint_worker_kill.py`` (see its docstring): a 2-rank torchrun
job whose rank 1 kills itself at a random moment of the step-2 save, and one process
that forks savers and kills them at random delays and just before every filesystem
commit call in turn. After every kill: ``latest`` names step 1 or step 2, step 1 is
byte-for-byte and mtime-for-mtime untouched, ``latest`` loads (checksums verified) with
exactly the values saved at its step, and (fork mode) the next save recovers.

The random seed is drawn per run and printed on failure (``CHECKPOINT_KILL_SEED`` fixes it).
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("checkpoint_kill")]

WORKER = Path(__file__).with_name("checkpoint_worker_kill.py")
REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("CHECKPOINT_KILL_SEED", random.randrange(1 << 30)))

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def test_sigkill_of_one_rank_during_a_distributed_save(tmp_path):
    from tests.distributed.checkpoint_worker_kill import check_root

    result = run_torchrun(
        WORKER,
        ["torchrun", "--out", str(tmp_path), "--seed", str(SEED)],
        nproc=2,
        timeout_s=300,
        cwd=REPO,
        check=False,
    )
    assert not result.ok and not result.timed_out, result.report()
    assert "Signals.SIGKILL" in result.output or "-9" in result.output, result.report()
    before = json.loads((tmp_path / "before.json").read_text())
    problem = check_root(tmp_path / "root", before["step1"])
    assert problem == "", (
        f"seed {SEED}, kill after {before['delay_s']:.3f} s of a {before['save_s']:.3f} s save: {problem}"
    )


def test_sigkill_at_random_moments_and_at_every_commit_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(WORKER), "fork", "--out", str(tmp_path), "--seed", str(SEED)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    cases = result["cases"]
    bad = [c for c in cases if c["problem"]]
    assert not bad, f"seed {SEED}: {bad}"
    phase = [c for c in cases if c["kind"] == "phase"]
    # every commit call was a kill point, and the last run saved without being killed
    assert all(c["killed"] for c in phase[:-1]) and not phase[-1]["killed"], phase
    # kills before the rename of `latest` keep step 1, kills after it show step 2
    seen = [c["latest_after_kill"] for c in phase]
    assert seen == sorted(seen) and seen[0].endswith("1") and seen[-1].endswith("2"), seen
    assert all(c["killed"] for c in cases if c["kind"] == "random"), cases
