"""torchrun launches whose records several test modules read (one launch per session).

The fixtures that run them live in ``tests/distributed/conftest.py``, so that pytest
holds one definition of each: a session fixture imported into two modules would be
two fixtures, and would launch twice.
"""

import json
from pathlib import Path
from typing import Any

import attrs

from areal_fn.runtime.launch import LaunchResult, run_torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DTENSOR_WORKER = HERE / "dtensor_worker.py"
DTENSOR_WORLD = 8
MEGATRON_WORKER = HERE / "megatron_worker.py"
MEGATRON_WORLD = 4


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


def launch_dtensor(out: Path) -> DistRun:
    """Every section of ``dtensor_worker.py`` in one 8-rank launch, records into ``out``."""
    result = run_torchrun(
        DTENSOR_WORKER,
        ["--out", str(out)],
        nproc=DTENSOR_WORLD,
        timeout_s=600,
        cwd=REPO,
        check=False,
    )
    summaries = tuple(
        json.loads(p.read_text())
        for r in range(DTENSOR_WORLD)
        if (p := out / f"rank{r}.json").exists()
    )
    return DistRun(result=result, summaries=summaries)


def launch_megatron(out: Path) -> Path:
    """``megatron_worker.py``'s per-case, per-rank JSON records, written into ``out``."""
    run_torchrun(
        MEGATRON_WORKER, ["--out", str(out)], nproc=MEGATRON_WORLD, timeout_s=1200, cwd=REPO
    )
    return out
