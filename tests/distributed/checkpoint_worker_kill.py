"""Kill a saving process with SIGKILL; the previous checkpoint must survive untouched.

Two modes, both writing ``<out>/result.json`` (``{"cases": [{...}], ...}``):

``torchrun`` (2 ranks, gloo)
    Both ranks save steps 0 and 1, then step 2; rank 1 SIGKILLs itself after a random
    delay drawn from [0, 1.5 x the duration of the step-1 save] (so anywhere in the DCP write,
    the checksums or the commit, or just after). The launcher then tears the job down.
    The test checks the directory afterwards (:func:`check_root`).
``fork`` (one process, no process group, both ranks of the layout)
    Saves step 1 once, then for every case copies that root, forks a child that saves
    step 2 into the copy, and SIGKILLs it: at random delays, and at every
    ``os.replace`` / ``os.rename`` / ``os.fsync`` / ``shutil.rmtree`` of the save in
    turn (the child kills itself just before its k-th such call, k = 1, 2, ... until a
    save completes). After each kill the parent checks the copy and saves step 3 into
    it (recovery: leftovers are cleaned, the new checkpoint commits).
"""

import argparse
import functools
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.runtime.checkpoint.api import RankState, load_checkpoint, save_checkpoint  # noqa: E402
from tests.distributed.checkpoint_worker_util import (  # noqa: E402
    blank_state,
    layout,
    model,
    rank_state,
    state_diff,
    tree_digest,
    truth,
)

SPEC = model()
ALLOC = "fsdp:d2"
STEP1, STEP2 = "step-00000001", "step-00000002"


@functools.lru_cache(maxsize=8)
def _rank_state(rank: int, salt: int) -> RankState:
    return rank_state(layout(SPEC, ALLOC), rank, truth(SPEC, salt), salt)


def states_for(ranks: list[int], salt: int) -> dict[int, RankState]:
    """Local states of ``ranks`` at step ``salt`` (cached: read, never written)."""
    return {r: _rank_state(r, salt) for r in ranks}


def save(root: Path, step: int, ranks: list[int], **kw: Any) -> Path:
    out = save_checkpoint(
        root,
        layout=layout(SPEC, ALLOC),
        states=states_for(ranks, step),
        model=SPEC,
        allocation=ALLOC,
        step=step,
        optimizer="adam",
        keep=3,
        **kw,
    )
    assert isinstance(out, Path)
    return out


def check_root(root: Path, step1: dict[str, str]) -> str:
    """The problem with ``root``, or empty when it holds an intact step 1 and a loadable ``latest``."""
    latest = (root / "latest").read_text().strip()
    if latest not in (STEP1, STEP2):
        return f"latest is {latest!r}"
    if tree_digest(root / STEP1) != step1:
        return "step 1 was modified"
    lay = layout(SPEC, ALLOC)
    got = {r: blank_state(lay, r) for r in range(lay.world_size)}
    res = load_checkpoint(root, layout=lay, states=got, optimizer="adam")
    want = states_for(list(range(lay.world_size)), res.step)
    diffs = [d for r in got for d in state_diff(got[r], want[r])]
    if diffs:
        return f"{latest} loads with {len(diffs)} tensors differing, e.g. {diffs[:3]}"
    return ""


# -- torchrun mode --------------------------------------------------------------------


def torchrun_mode(out: Path, seed: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = out / "root"
    save(root, 0, [rank])  # warm-up: step 1 then measures a warm save
    dist.barrier()
    start = time.perf_counter()
    save(root, 1, [rank])
    duration = time.perf_counter() - start
    dist.barrier()
    delay = random.Random(seed).uniform(0.0, 1.5 * duration)
    if rank == 0:
        info = {"step1": tree_digest(root / STEP1), "save_s": duration, "delay_s": delay}
        (out / "before.json").write_text(json.dumps(info))
    dist.barrier()
    if rank == 1:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    save(root, 2, [rank])
    time.sleep(30)  # rank 1 is killed during or after its save in any case


# -- fork mode ------------------------------------------------------------------------


def _kill_at(k: int) -> None:
    """In the child: SIGKILL this process just before its k-th filesystem commit call."""
    count = [0]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **kw: Any) -> Any:
            count[0] += 1
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **kw)

        return inner

    os.replace = wrap(os.replace)  # type: ignore[assignment]
    os.rename = wrap(os.rename)  # type: ignore[assignment]
    os.fsync = wrap(os.fsync)  # type: ignore[assignment]
    shutil.rmtree = wrap(shutil.rmtree)  # type: ignore[assignment]


def _child_save(root: Path, kill_at: int | None) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if kill_at is not None:
                _kill_at(kill_at)
            save(root, 2, [0, 1])
            if kill_at is None:
                time.sleep(30)  # a random kill lands during the save or after it, never misses
        except BaseException:
            code = 3
        os._exit(code)
    return pid


def fork_mode(out: Path, seed: int, random_kills: int) -> None:
    rng = random.Random(seed)
    base = out / "base"
    save(base, 1, [0, 1])
    runs = []
    for i in range(3):  # a warm save's duration: the window the random kills aim at
        scratch = out / f"scratch{i}"
        shutil.copytree(base, scratch)
        start = time.perf_counter()
        save(scratch, 2, [0, 1])
        runs.append(time.perf_counter() - start)
        shutil.rmtree(scratch)
    duration = min(runs)
    cases: list[dict[str, Any]] = []

    def one(kind: str, delay: float | None, kill_at: int | None) -> bool:
        root = out / f"case{len(cases)}"
        shutil.copytree(base, root)
        step1 = tree_digest(root / STEP1)
        pid = _child_save(root, kill_at)
        if delay is not None:
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        problem = check_root(root, step1)
        latest = (root / "latest").read_text().strip()
        if not problem:
            try:
                save(root, 3, [0, 1])
                left = [p.name for p in root.iterdir() if p.name.startswith(".")]
                if left or (root / "latest").read_text().strip() != "step-00000003":
                    problem = f"after recovery: leftovers {left}"
            except Exception as e:
                problem = f"save after the kill failed: {type(e).__name__}: {e}"
        cases.append(
            {
                "kind": kind,
                "delay_s": delay,
                "kill_at": kill_at,
                "killed": killed,
                "latest_after_kill": latest,
                "problem": problem,
            }
        )
        shutil.rmtree(root, ignore_errors=True)
        return killed

    for _ in range(random_kills):
        one("random", rng.uniform(0.0, 1.5 * duration), None)
    k = 1
    while one("phase", None, k) and k < 200:
        k += 1
    (out / "result.json").write_text(
        json.dumps({"save_s": duration, "seed": seed, "cases": cases}, indent=1)
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("torchrun", "fork"))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-kills", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    if args.mode == "torchrun":
        torchrun_mode(out, args.seed)
    else:
        fork_mode(out, args.seed, args.random_kills)


if __name__ == "__main__":
    main()
