"""Checkpoints across strategies and world sizes, under torchrun (4 ranks, gloo, CPU).

One launch of ``checkpoint_worker.py`` runs every check (see its docstring); each test
below reads the per-rank records. Saved parameters (bf16), Adam moments (fp32) and
step counts must load bitwise equal under the other layout.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("checkpoint_dist")]

WORKER = Path(__file__).with_name("checkpoint_worker.py")
REPO = Path(__file__).resolve().parents[2]
WORLD = 4

MATRIX = [
    "fsdp:d4 -> fsdp:d2t2",
    "fsdp:d2t2 -> megatron:t2p2",
    "megatron:t2p2 -> fsdp:d4",
    "fsdp:d4 -> megatron:d2t2p2",  # 8 ranks, two per process
    "megatron:t2 -> fsdp:d4",  # saved by 2 processes
    "fsdp:d2t2 -> fsdp:d2t2",  # same strategy: RNG states restored too
]
OTHER = [
    "async save",
    "retention",
    "load an older step by its directory",
    "other model raises on every rank",
    "corrupted file raises on every rank",
]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("checkpoint_dist")
    run_torchrun(WORKER, ["--out", str(out)], nproc=WORLD, timeout_s=600, cwd=REPO)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _problems(records: list[dict[str, Any]], name: str) -> list[str]:
    out = []
    for r, rec in enumerate(records):
        if name not in rec["checks"]:
            out.append(f"rank {r}: check did not run")
        elif rec["checks"][name]:
            out.append(f"rank {r}: {rec['checks'][name]}")
    return out


@pytest.mark.parametrize("case", MATRIX)
def test_save_under_one_strategy_load_under_another_bitwise(records, case):
    assert not _problems(records, case), _problems(records, case)


@pytest.mark.parametrize("case", OTHER)
def test_checkpoint_behaviour(records, case):
    assert not _problems(records, case), _problems(records, case)


def test_loads_leave_every_checkpoint_untouched(records):
    assert records[0]["checks"].get("loads leave checkpoints untouched") == ""


def test_every_rank_saved_into_the_step_directory(records):
    for r, rec in enumerate(records):
        for name, problem in rec["checks"].items():
            if name.startswith("save "):
                assert problem == "", f"rank {r}: {name}: {problem}"
