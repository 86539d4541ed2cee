"""torchrun worker (4 ranks, gloo): checkpoints saved under one strategy, loaded under another.

Launched once by ``tests/distributed/test_checkpoint_dist.py``. Every rank builds its local
state from canonical truth (``checkpoint_worker_util``), saves, loads into NaN-filled
local tensors of another layout and compares bitwise with what ``to_megatron`` makes
of the truth. Results go to ``<out>/rank<r>.json`` as ``{"checks": {name: problem or
""}, "timings": {...}}``; checks record instead of raising, so no rank is left
waiting in a collective.

Sections: the strategy matrix (fsdp:d4 -> fsdp:d2t2, fsdp:d2t2 -> megatron:t2p2,
megatron:t2p2 -> fsdp:d4, fsdp:d4 -> megatron:d2t2p2 on 8 ranks with two per
process, megatron:t2 saved by 2 processes -> fsdp:d4), RNG / scheduler / data
position restored, async save, retention and ``latest``, errors raised on every rank
(other model, corrupted file), and saved directories untouched by all the loads.
"""

import argparse
import functools
import json
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import CheckpointError  # noqa: E402
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    RankState,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
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
SOURCES = {  # allocation -> (salt, processes that save it)
    "fsdp:d4": (1, 4),
    "fsdp:d2t2": (2, 4),
    "megatron:t2p2": (3, 4),
    "megatron:t2": (4, 2),
}
MATRIX = [
    ("fsdp:d4", "fsdp:d2t2"),
    ("fsdp:d2t2", "megatron:t2p2"),
    ("megatron:t2p2", "fsdp:d4"),
    ("fsdp:d4", "megatron:d2t2p2"),
    ("megatron:t2", "fsdp:d4"),
    ("fsdp:d2t2", "fsdp:d2t2"),
]


class Checks:
    def __init__(self) -> None:
        self.results: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    def record(self, name: str, problem: str) -> None:
        self.results[name] = problem

    def run(self, name: str, fn: Any, *args: Any) -> Any:
        try:
            out = fn(*args)
        except Exception:
            self.results[name] = traceback.format_exc()[-3000:]
            return None
        self.results.setdefault(name, "")
        return out


def my_ranks(world: int, rank: int, size: int) -> list[int]:
    return [r for r in range(rank, world, size)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    checks = Checks()
    pair = dist.new_group([0, 1])
    try:
        run_all(checks, rank, size, out, pair)
    finally:
        (out / f"rank{rank}.json").write_text(
            json.dumps({"checks": checks.results, "timings": checks.timings}, indent=1)
        )
        dist.barrier()
        dist.destroy_process_group()


def seed_all(rank: int) -> None:
    random.seed(rank + 7)
    np.random.seed(rank + 7)
    torch.manual_seed(rank + 7)


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def run_all(checks: Checks, rank: int, size: int, out: Path, pair: Any) -> None:
    truths = {a: truth(SPEC, salt) for a, (salt, _) in SOURCES.items()}
    digests: dict[str, dict[str, str]] = {}
    after_save: list[float] = []
    # -- saves ------------------------------------------------------------------------
    for alloc, (salt, procs) in SOURCES.items():
        if rank >= procs:
            continue
        lay = layout(SPEC, alloc)
        seed_all(rank)
        states = {
            r: rank_state(lay, r, truths[alloc], salt)
            for r in my_ranks(lay.world_size, rank, procs)
        }
        start = time.perf_counter()
        path = save_checkpoint(
            out / alloc,
            layout=lay,
            states=states,
            model=SPEC,
            allocation=alloc,
            step=salt,
            optimizer="adam",
            data_position={"epoch": 1, "sample": 1000 + salt},
            lr_scheduler={"last_epoch": salt, "_last_lr": [1e-5 * salt]},
            process_group=pair if procs == 2 else None,
        )
        checks.timings[f"save {alloc}"] = time.perf_counter() - start
        if alloc == "fsdp:d2t2":
            after_save = draws()
        checks.record(
            f"save {alloc} path", "" if Path(str(path)).name == f"step-{salt:08d}" else str(path)
        )
    dist.barrier()
    if rank == 0:
        digests = {a: tree_digest(out / a) for a in SOURCES}
    # -- strategy matrix --------------------------------------------------------------
    for src, dst in MATRIX:
        name = f"{src} -> {dst}"
        salt = SOURCES[src][0]
        lay = layout(SPEC, dst)
        mine = my_ranks(lay.world_size, rank, size)
        states = {r: blank_state(lay, r) for r in mine}
        random.random(), np.random.rand(), torch.rand(())  # move the RNGs on
        start = time.perf_counter()
        res = checks.run(
            name,
            functools.partial(
                load_checkpoint, out / src, layout=lay, states=states, optimizer="adam"
            ),
        )
        checks.timings[f"load {name}"] = time.perf_counter() - start
        after_load = draws()
        if res is None:
            continue
        problems = []
        for r in mine:
            diff = state_diff(states[r], rank_state(lay, r, truths[src], salt))
            if diff:
                problems.append(f"rank {r}: {len(diff)} tensors differ, e.g. {diff[:4]}")
        if res.step != salt or res.data_position != {"epoch": 1, "sample": 1000 + salt}:
            problems.append(f"step {res.step} data position {res.data_position}")
        if res.lr_scheduler != {"last_epoch": salt, "_last_lr": [1e-5 * salt]}:
            problems.append(f"lr scheduler {res.lr_scheduler}")
        same_world = lay.world_size == SOURCES[src][1] == size
        if res.rng_restored != (same_world and len(mine) == 1):
            problems.append(f"rng_restored={res.rng_restored}")
        if src == dst == "fsdp:d2t2" and after_load != after_save:
            problems.append("RNG draws after load differ from the draws right after save")
        checks.record(name, "; ".join(problems))
    # -- async save: state is copied before save returns ----------------------------------
    lay = layout(SPEC, "fsdp:d4")
    t = truth(SPEC, 9)
    st = rank_state(lay, rank, t, 9)
    pending = save_checkpoint(
        out / "async",
        layout=lay,
        states={rank: st},
        model=SPEC,
        allocation="fsdp:d4",
        step=9,
        optimizer="adam",
        blocking=False,
    )
    for v in st.params.values():
        v.add_(1.0)  # the training step goes on
    for moments in st.optim.values():
        moments["exp_avg"].mul_(2.0)
    path = checks.run("async save", pending.wait)  # type: ignore[union-attr]
    if path is not None:
        back = {rank: blank_state(lay, rank)}
        load_checkpoint(out / "async", layout=lay, states=back, optimizer="adam")
        diff = state_diff(back[rank], rank_state(lay, rank, t, 9))
        checks.record("async save", f"{len(diff)} tensors differ, e.g. {diff[:3]}" if diff else "")
    # -- retention and latest -----------------------------------------------------------
    for step in (1, 2, 3):
        save_checkpoint(
            out / "ret",
            layout=lay,
            states={rank: rank_state(lay, rank, t, 9)},
            model=SPEC,
            allocation="fsdp:d4",
            step=step,
            keep=2,
            optimizer="adam",
        )
    names = [p.name for _, p in list_checkpoints(out / "ret")]
    latest = (out / "ret" / "latest").read_text().strip()
    checks.record(
        "retention",
        ""
        if names == ["step-00000002", "step-00000003"] and latest == "step-00000003"
        else f"{names} latest={latest}",
    )
    back = {rank: RankState(params=blank_state(lay, rank).params)}
    res = checks.run(
        "load an older step by its directory",
        lambda: load_checkpoint(out / "ret" / "step-00000002", layout=lay, states=back),
    )
    if res is not None and res.step != 2:
        checks.record("load an older step by its directory", f"step {res.step}")
    # -- errors on every rank, no hang --------------------------------------------------
    other = model(hidden_size=128)
    olay = layout(other, "megatron:t2p2")
    try:
        load_checkpoint(
            out / "megatron:t2p2",
            layout=olay,
            states={rank: blank_state(olay, rank)},
            optimizer="adam",
        )
        checks.record("other model raises on every rank", "no error")
    except CheckpointError as e:
        ok = "was saved for another model" in str(e)
        checks.record("other model raises on every rank", "" if ok else str(e))
    if rank == 0:
        bad = out / "corrupt"
        shutil.copytree(out / "megatron:t2p2", bad)
        step_dir = bad / "step-00000003"
        f = step_dir / "__3_0.distcp"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    dist.barrier()
    lay = layout(SPEC, "megatron:t2p2")
    try:
        load_checkpoint(
            out / "corrupt", layout=lay, states={rank: blank_state(lay, rank)}, optimizer="adam"
        )
        checks.record("corrupted file raises on every rank", "no error")
    except CheckpointError as e:
        checks.record(
            "corrupted file raises on every rank",
            "" if "__3_0.distcp has blake3" in str(e) else str(e),
        )
    # -- nothing saved was modified by any load -----------------------------------------
    dist.barrier()
    if rank == 0:
        changed = [a for a in SOURCES if tree_digest(out / a) != digests[a]]
        checks.record("loads leave checkpoints untouched", f"changed: {changed}" if changed else "")


if __name__ == "__main__":
    main()
