"""Checkpoints against the libraries AReaL calls: torch DCP and Megatron-Core's
``dist_checkpointing``, same state, same disk, one run, with the disk's own bandwidth.

One torchrun launch of 2 CPU processes (gloo, one thread each); every file goes to one
directory on the temporary directory's disk (``BENCH_CKPT_DIR`` overrides it).

- **disk**, a third side in every round of both parts: each rank writes as many bytes
  as its share of the state as ``THREADS`` files at once (the saves' writer threads),
  each sequentially in 64 MiB chunks, then ``fsync`` (both ranks at once, as the saves
  write), and reads the last ones back: the physical limits the saves and loads are
  compared with.
- **fsdp2**: an :class:`~areal_fn.runtime.engines.fsdp2.Fsdp2Engine` (``fsdp:d2``, fp32
  parameters, AdamW moments filled with random values). Ours:
  :func:`~areal_fn.runtime.checkpoint.api.save_checkpoint` of its local state and
  optimizer state (``thread_count=THREADS`` writer threads, BLAKE3 of every file taken
  while writing, fsync, manifest, atomic commit) and
  :func:`~areal_fn.runtime.checkpoint.api.load_checkpoint` with checksum verification.
  DCP: ``dcp.save`` of ``get_state_dict(model, optimizer)`` with
  ``FileSystemWriter(thread_count=THREADS, sync_files=True)`` and ``dcp.load`` of the
  same state dict followed by ``set_state_dict`` (what AReaL's FSDP engine does).
- **megatron**: a Megatron-Core ``GPTModel`` under tp=2 (CPU, local spec, fp32
  parameters as the FSDP2 engine's). Ours: ``save_checkpoint`` / ``load_checkpoint``
  of its parameters (the ``megatron:t2`` layout). Megatron:
  ``dist_checkpointing.save(model.sharded_state_dict(), dir)`` (``torch_dist``, its
  default of 2 writer threads) and ``dist_checkpointing.load``
  then ``load_state_dict``. The optimizer is left out: Megatron's distributed optimizer
  is not built on CPU here.

Each side saves ``ROUNDS`` times, the sides taking turns, keeping its previous copy
(the one before it is deleted untimed). Loads: ``ROUNDS`` rounds with the files in the
page cache ("warm"), then ``ROUNDS`` rounds after ``posix_fadvise(DONTNEED)`` of every
file of both checkpoints and of the disk's file ("cold": read from the device, or from
whatever cache the host keeps under this VM's disk); every checkpoint load starts from
zeroed tensors and is checked bitwise against the saved state. Loads also run ours
with ``verify=False`` (``ours_nv``: no checksum pass before the reads), to show what
the verification costs. Times are wall time
barrier to barrier, the slower rank's; ratios are the median over rounds of the
per-round ratio (the machine's load moves the sides of one round alike).

Run: ``.venv/bin/python -m bench ckpt_peers``.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402

MODEL = ROOT / "specs" / "models" / "Qwen2.5-0.5B.json"
#: the 0.5B model's widths with a smaller vocabulary and 4 layers (89M parameters)
SHAPE = {"num_hidden_layers": 4, "max_window_layers": 4, "vocab_size": 32768}
ROUNDS = 3
THREADS = 2
WORLD = 2
CHUNK = 64 << 20

Timings = dict[str, list[float]]


def spec() -> ModelSpec:
    return model_from_hf_config({**json.loads(MODEL.read_text()), **SHAPE})


# ----------------------------------------------------------------------------- helpers
def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _files(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*")) if p.is_file())


def _evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (they are fsync'ed: clean pages)."""
    for p in _files(folder):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _bits(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _snapshot(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def _equal(tensors: dict[str, Any], want: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(_bits(tensors[k]), _bits(w)) for k, w in want.items())


def _zero(tensors: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for t in tensors.values():
            t.zero_()


# ----------------------------------------------------------------------------- disk
def _disk(
    folder: Path, nbytes: int
) -> tuple[Callable[[int], Callable[[], Any]], Callable[[], None]]:
    """The disk as a third side: (a save: write ``nbytes`` as ``THREADS`` files at once,
    each sequentially in 64 MiB chunks, then fsync; a load: read those files back)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    folder.mkdir(exist_ok=True)
    block = os.urandom(CHUNK)
    share = -(-nbytes // THREADS)

    def path(i: int, k: int) -> Path:
        return folder / f"dd-{i}-rank{dist.get_rank()}-{k}"

    def write_one(p: Path) -> None:
        with open(p, "wb", buffering=0) as f:
            left = share
            while left > 0:
                left -= f.write(memoryview(block)[: min(left, CHUNK)])
            os.fsync(f.fileno())

    def read_one(p: Path) -> None:
        buf = bytearray(CHUNK)
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def write(i: int) -> Callable[[], Any]:
        def save() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(write_one, [path(i, k) for k in range(THREADS)]))

        return save

    def read() -> None:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(read_one, [path(ROUNDS - 1, k) for k in range(THREADS)]))

    return write, read


# ----------------------------------------------------------------------------- fsdp2
def _fsdp2(folder: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from areal_fn.runtime.checkpoint.api import RankState, load_checkpoint, save_checkpoint
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.strategy.allocation import ParallelDims

    s, rank = spec(), dist.get_rank()
    engine = Fsdp2Engine(s, ParallelDims(dp=2), seed=0)
    gen = torch.Generator().manual_seed(rank)
    optim = engine.optimizer_local_state(create=True)
    with torch.no_grad():
        for states in optim.values():
            states["exp_avg"].uniform_(-1e-3, 1e-3, generator=gen)
            states["exp_avg_sq"].uniform_(0, 1e-6, generator=gen)
            states["step"].fill_(10)

    def live() -> dict[str, Any]:
        """The engine's live tensors now (a load may replace the optimizer's)."""
        flat = dict(engine.local_state())
        for n, st in engine.optimizer_local_state().items():
            flat.update({f"{n}/{k}": v for k, v in st.items()})
        return flat

    def mine() -> dict[int, RankState]:
        return {rank: RankState(params=engine.local_state(), optim=engine.optimizer_local_state())}

    want = _snapshot(live())
    nbytes = sum(t.numel() * t.element_size() for t in want.values())

    def ours_save(i: int) -> Callable[[], Any]:
        return lambda: save_checkpoint(
            folder / "ours", layout=engine.layout, states=mine(), model=s, allocation="fsdp:d2",
            step=i, optimizer="adamw", keep=2, save_rng=False, thread_count=THREADS,
        )  # fmt: skip

    def dcp_save(i: int) -> Callable[[], Any]:
        def save() -> None:
            sd = dict(zip(("model", "optim"), get_state_dict(engine.model, engine.optimizer)))
            writer = dcp.FileSystemWriter(folder / f"dcp-{i}", thread_count=THREADS)
            dcp.save(sd, storage_writer=writer)

        return save

    def ours_load(verify: bool = True) -> None:
        load_checkpoint(
            folder / "ours", layout=engine.layout, states=mine(), optimizer="adamw", verify=verify
        )

    def dcp_load() -> None:
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder / f"dcp-{ROUNDS - 1}"))
        set_state_dict(
            engine.model,
            engine.optimizer,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
        )

    disk_save, disk_load = _disk(folder / "disk", nbytes)
    saves = _save_rounds(
        {"ours": ours_save, "dcp": dcp_save, "disk": disk_save},
        {"ours": lambda i: folder / "ours" / f"step-{i:08d}", "dcp": lambda i: folder / f"dcp-{i}"},
    )
    loads = _load_rounds(
        {
            "ours": ours_load,
            "dcp": dcp_load,
            "disk": disk_load,
            "ours_nv": lambda: ours_load(False),
        },
        [folder / "ours", folder / f"dcp-{ROUNDS - 1}", folder / "disk"],
        live,
        want,
    )
    return {"bytes": nbytes, **saves, **loads}


# ----------------------------------------------------------------------------- megatron
def _megatron(folder: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.layouts.vocab import padded_vocab_size
    from areal_fn.runtime.checkpoint.api import RankState, load_checkpoint, save_checkpoint
    from areal_fn.runtime.megatron.build import (
        MegatronSizes,
        build_gpt_model,
        megatron_session,
        transformer_config,
    )
    from areal_fn.runtime.megatron.config import arch_of
    from areal_fn.strategy.allocation import ParallelDims

    s, rank, sizes = spec(), dist.get_rank(), MegatronSizes(tp=2)
    with megatron_session(sizes):
        arch = arch_of(s)
        config = transformer_config(arch, sizes, params_dtype=torch.float32)
        gpt = build_gpt_model(arch, config, vocab_size=padded_vocab_size(s.vocab_size, tp=2))
        layout = megatron_layout(s, ParallelDims(tp=2))
        params = dict(gpt.named_parameters())
        mine = {
            rank: RankState(
                params={lt.name: params[lt.name].data for lt in layout.local_tensors(rank)}
            )
        }
        want = _snapshot(mine[rank].params)
        nbytes = sum(t.numel() * t.element_size() for t in want.values())

        def ours_save(i: int) -> Callable[[], Any]:
            return lambda: save_checkpoint(
                folder / "ours", layout=layout, states=mine, model=s, allocation="megatron:t2",
                step=i, keep=2, save_rng=False, thread_count=THREADS,
            )  # fmt: skip

        def mcore_save(i: int) -> Callable[[], Any]:
            def save() -> None:
                (folder / f"mcore-{i}").mkdir(exist_ok=True)
                dist_checkpointing.save(gpt.sharded_state_dict(), str(folder / f"mcore-{i}"))

            return save

        def ours_load(verify: bool = True) -> None:
            load_checkpoint(folder / "ours", layout=layout, states=mine, verify=verify)

        def mcore_load() -> None:
            path = str(folder / f"mcore-{ROUNDS - 1}")
            gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), path))

        disk_save, disk_load = _disk(folder / "disk", nbytes)
        saves = _save_rounds(
            {"ours": ours_save, "megatron": mcore_save, "disk": disk_save},
            {
                "ours": lambda i: folder / "ours" / f"step-{i:08d}",
                "megatron": lambda i: folder / f"mcore-{i}",
            },
        )
        loads = _load_rounds(
            {
                "ours": ours_load,
                "megatron": mcore_load,
                "disk": disk_load,
                "ours_nv": lambda: ours_load(False),
            },
            [folder / "ours", folder / f"mcore-{ROUNDS - 1}", folder / "disk"],
            lambda: mine[rank].params,
            want,
        )
    return {"bytes": nbytes, **saves, **loads}


# ----------------------------------------------------------------------------- rounds
def _save_rounds(
    saves: dict[str, Callable[[int], Callable[[], Any]]], where: dict[str, Callable[[int], Path]]
) -> dict[str, Timings]:
    """``ROUNDS`` saves per side, in turns; each side's copy before last deleted untimed."""
    import torch.distributed as dist

    out: Timings = {name: [] for name in saves}
    for i in range(ROUNDS):
        for name, save in saves.items():
            if i >= 2 and dist.get_rank() == 0 and name in where:
                shutil.rmtree(where[name](i - 2), ignore_errors=True)
            out[name].append(_timed(save(i)))
    return {"save": out}


def _load_rounds(
    loads: dict[str, Callable[[], None]],
    folders: list[Path],
    live: Callable[[], dict[str, Any]],
    want: dict[str, Any],
) -> dict[str, Any]:
    """Warm, then cold rounds of every side's load, each from zeroed tensors, checked."""
    import torch.distributed as dist

    out: dict[str, Timings] = {"warm": {n: [] for n in loads}, "cold": {n: [] for n in loads}}
    equal = True
    for kind in ("warm", "cold"):
        for _ in range(ROUNDS):
            for name, load in loads.items():
                _zero(live())
                if kind == "cold" and dist.get_rank() == 0:
                    for f in folders:
                        _evict(f)
                out[kind][name].append(_timed(load))
                equal &= name == "disk" or _equal(live(), want)
    return {"load_warm": out["warm"], "load_cold": out["cold"], "equal": equal}


def _worker(folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for part in ("fsdp2", "megatron"):
        (folder / part).mkdir(exist_ok=True)
    record = {"fsdp2": _fsdp2(folder / "fsdp2"), "megatron": _megatron(folder / "megatron")}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def _per_round(recs: list[dict[str, Any]], part: str, what: str, side: str) -> list[float]:
    """The slower rank's time of each round."""
    return [max(r[part][what][side][i] for r in recs) for i in range(ROUNDS)]


def _line(label: str, gb: float, ts: list[float]) -> str:
    rounds = ", ".join(f"{t:.2f}" for t in ts)
    return f"  {label:<20}{min(ts):7.2f} s {gb / min(ts):6.2f} GB/s   rounds {rounds}"


def _median_ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of ``num[i] / den[i]``."""
    return statistics.median(n / d for n, d in zip(num, den, strict=True))


def _part(recs: list[dict[str, Any]], part: str, peer: str) -> None:
    gb = sum(r[part]["bytes"] for r in recs) / 1e9
    print(f"{part}: {gb:.3f} GB of state over {WORLD} ranks; peer {peer}")
    goals = []
    for what in ("save", "load_warm", "load_cold"):
        sides = ("ours", peer, "disk") + (("ours_nv",) if what != "save" else ())
        ts = {side: _per_round(recs, part, what, side) for side in sides}
        for side, t in ts.items():
            print(_line(f"{what} {side}", gb, t))
        speed = _median_ratio(ts[peer], ts["ours"])
        print(
            f"    {what}, medians over rounds: speed ours / {peer} x{speed:.2f} (rounds "
            f"{', '.join(f'x{p / o:.2f}' for o, p in zip(ts['ours'], ts[peer], strict=True))}); "
            f"of the disk's own speed: ours {_median_ratio(ts['disk'], ts['ours']):.2f}, "
            f"{peer} {_median_ratio(ts['disk'], ts[peer]):.2f}"
            + (
                f"; ours without checksum verification (ours_nv) x"
                f"{_median_ratio(ts[peer], ts['ours_nv']):.2f} of {peer}'s speed"
                if "ours_nv" in ts
                else ""
            )
        )
        goals.append(f"{what} x{speed:.2f}")
    equal = all(r[part]["equal"] for r in recs)
    print(f"  goals ({part}, median speed ours / {peer}, >= 1 met): {', '.join(goals)}; "
          f"every load bitwise equal to the saved state: {equal}")  # fmt: skip


def run() -> None:
    from areal_fn.runtime.launch import run_torchrun

    base = os.environ.get("BENCH_CKPT_DIR") or None
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_peers_", dir=base) as tmp:
        folder, out = Path(tmp) / "ckpt", Path(tmp) / "out"
        folder.mkdir()
        out.mkdir()
        print(f"directory: {folder} ({shutil.disk_usage(folder).free / 1e9:.0f} GB free); "
              f"{WORLD} processes, gloo, 1 thread each; {THREADS} writer threads per rank on "
              f"every side; {ROUNDS} rounds, the sides in turns")  # fmt: skip
        run_torchrun(
            Path(__file__),
            ["--worker", str(folder), str(out)],
            nproc=WORLD,
            timeout_s=1500,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    _part(recs, "fsdp2", "dcp")
    _part(recs, "megatron", "megatron")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(*args.worker)
    else:
        run()
