"""What a checkpoint's processes hold: rank states, RNG states, the process group.

:class:`RankState` (one rank's local tensors and optimizer state), :class:`LoadResult`
and :class:`PendingSave` are the records :mod:`~areal_fn.runtime.checkpoint.api` hands
out; :func:`capture_rng` / :func:`restore_rng` the RNG states a save keeps per process;
``_Group`` the processes taking part, which agree on every error (nobody hangs alone);
``_check_states`` the one check of rank states against a layout and an optimizer,
before a save or a load touches anything.
"""

import random
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from areal_fn.errors import CheckpointError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.plans.checkpoint.manifest import CheckpointManifest, OptimizerSpec
from areal_fn.plans.tensor_check import check_local_tensors, listing

_LR_KEY = "train/lr_scheduler"
_RNG_PREFIX = "rng/"


@attrs.define(kw_only=True)
class RankState:
    """One rank's local tensors and optimizer state (tensors live here, not in records)."""

    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class LoadResult:
    """What a load restored besides the tensors."""

    path: Path
    manifest: CheckpointManifest
    step: int
    data_position: Any
    lr_scheduler: dict[str, Any] | None
    rng_restored: bool


@attrs.define
class PendingSave:
    """An asynchronous save: state was copied; writing and commit run in the background."""

    path: Path
    _thread: threading.Thread
    _error: list[BaseException]

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until committed; raise what the save raised."""
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self.path


# -- process group -------------------------------------------------------------------


class _Group:
    """The processes taking part (none: this process alone)."""

    def __init__(self, pg: "dist.ProcessGroup | None") -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.pg = pg
        self.rank = dist.get_rank(pg) if self.on else 0
        self.size = dist.get_world_size(pg) if self.on else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, error: str | None) -> None:
        """Raise the first process's error on every process (nobody hangs alone)."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])


def _error(e: BaseException) -> str:
    return str(e) if isinstance(e, SpecError) else f"{type(e).__name__}: {e}"


# -- rng -----------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU, and CUDA when present) RNG states."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- state checks --------------------------------------------------------------------


def _check_states(layout: Layout, states: Mapping[int, RankState], opt: OptimizerSpec) -> None:
    """``CheckpointError`` unless each rank's tensors and optimizer state fit ``layout``."""
    check_local_tensors(
        layout,
        {r: {n: tuple(t.shape) for n, t in st.params.items()} for r, st in states.items()},
        error=CheckpointError,
        also={
            r: _optim_problems(layout, r, st, opt)
            for r, st in states.items()
            if 0 <= r < layout.world_size
        },
    )


def _optim_problems(layout: Layout, r: int, st: RankState, opt: OptimizerSpec) -> list[str]:
    """What is wrong with rank ``r``'s optimizer state under ``opt`` (empty: nothing)."""
    if opt.name == "none":
        if st.optim:
            return [
                f"rank {r} passes optimizer state but optimizer='none'; name the optimizer (e.g. 'adam')"
            ]
        return []
    problems: list[str] = []
    want = {lt.name: lt for lt in layout.local_tensors(r)}
    names = tuple(x.name for x in opt.states)
    for n, lt in want.items():
        s = st.optim.get(n)
        if s is None:
            problems.append(f"rank {r}: no {opt.name} state for {n}")
            continue
        if set(s) != set(names):
            problems.append(
                f"rank {r}: {n} has optimizer states {sorted(s)}, {opt} needs {list(names)}"
            )
            continue
        for x in opt.states:
            shape = tuple(s[x.name].shape)
            if x.kind == "moment" and shape != lt.shape:
                problems.append(
                    f"rank {r}: {n} {x.name} has shape {shape}, the parameter {lt.shape}"
                )
            if x.kind == "scalar" and s[x.name].numel() != 1:
                problems.append(f"rank {r}: {n} {x.name} has shape {shape}, a scalar is expected")
    extra = sorted(n for n in st.optim if n not in want)
    if extra:
        problems.append(f"rank {r} has optimizer state for unknown tensors {listing(extra)}")
    return problems
