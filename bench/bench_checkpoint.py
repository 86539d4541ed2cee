"""Checkpoint save / load throughput against torch.save / torch.load, and reshard-on-load cost.

State: a Qwen2.5-0.5B-shaped model (hidden 896, vocab 151936, 14 heads / 2 KV heads,
intermediate 4864) with its decoder scaled from 24 to ``LAYERS`` layers to fit a small
machine: bfloat16 parameters plus Adam ``exp_avg`` / ``exp_avg_sq`` in float32 and a
step per tensor, laid out ``fsdp:d2`` (both ranks held by this one process, no
process group: the offline form of the same code path).

Timed, one process, same run, same bytes:

- save: :func:`areal_fn.runtime.checkpoint.api.save_checkpoint` (DCP files, every file
  fsync'ed and its BLAKE3 taken as it is written, manifest, atomic commit) against
  ``torch.save`` of each rank's ``{name: tensor}`` dict into one file per rank, then
  ``fsync`` (same durability);
- load, same strategy: :func:`load_checkpoint` into preallocated local tensors, with
  and without checksum verification, against ``torch.load`` of those files;
- load, resharded: the same checkpoint into ``megatron:t2`` (fused QKV and gate/up,
  padded vocabulary), with and without verification, against ``torch.load`` too.

The last line prints the speed ratios (torch's time / ours: >= 1.0 is at least as fast)
of the save, the verified load and the verified resharded load. Files go to
``/dev/shm`` (tmpfs) when it has room, else to the temporary directory: on a shared
disk both sides are bound by the disk and its neighbours, on tmpfs the figures compare
the software (serialisation, checksums, copies). Saves include the ``fsync`` (both
sides); before the loads every file is read once (page cache). Run:
``python -m bench checkpoint``.
"""

import functools
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from areal_fn.cli import layout_for
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec, load_hf_config, model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.runtime.checkpoint.api import RankState, load_checkpoint, save_checkpoint
from areal_fn.strategy.parse import parse_allocation

LAYERS = 2
SAVE_REPEATS = 5
LOAD_REPEATS = 3
SHM = Path("/dev/shm")
CONFIG = Path(__file__).resolve().parents[1] / "specs" / "models" / "Qwen2.5-0.5B.json"


def _model() -> ModelSpec:
    cfg = load_hf_config(CONFIG)
    cfg["num_hidden_layers"] = LAYERS
    cfg["max_window_layers"] = LAYERS
    return model_from_hf_config(cfg)


def _layout(spec: ModelSpec, alloc: str) -> Layout:
    return layout_for(spec, parse_allocation(alloc).components[0])


def _states(spec: ModelSpec, lay: Layout) -> dict[int, RankState]:
    g = torch.Generator().manual_seed(0)
    canon = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors}
    out = {}
    for r in range(lay.world_size):
        params = to_megatron(canon, lay, r)
        out[r] = RankState(
            params=params,
            optim={
                n: {
                    "exp_avg": p.float().mul_(0.1),
                    "exp_avg_sq": p.float().square_(),
                    "step": torch.tensor(10.0),
                }
                for n, p in params.items()
            },
        )
    return out


def _blank(lay: Layout) -> dict[int, RankState]:
    out = {}
    for r in range(lay.world_size):
        params = {
            lt.name: torch.empty(lt.shape, dtype=torch.bfloat16) for lt in lay.local_tensors(r)
        }
        out[r] = RankState(
            params=params,
            optim={
                n: {
                    "exp_avg": torch.empty(p.shape),
                    "exp_avg_sq": torch.empty(p.shape),
                    "step": torch.tensor(0.0),
                }
                for n, p in params.items()
            },
        )
    return out


def _flat(st: RankState) -> dict[str, torch.Tensor]:
    out = dict(st.params)
    for n, states in st.optim.items():
        for k, v in states.items():
            out[f"{n}/{k}"] = v
    return out


def _nbytes(states: dict[int, RankState]) -> int:
    return sum(t.numel() * t.element_size() for st in states.values() for t in _flat(st).values())


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _scratch(need: int) -> Path | None:
    """tmpfs when it has room (the figures then measure software, not the shared disk)."""
    if SHM.is_dir() and shutil.disk_usage(SHM).free > 2 * need:
        return SHM
    return None


def _warm(folder: Path) -> int:
    """Read every file once (page cache), so that loads compare CPU work, not the disk."""
    total = 0
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while chunk := f.read(64 << 20):
                    total += len(chunk)
    return total


def _torch_save(states: dict[int, RankState], folder: Path) -> None:
    folder.mkdir()
    for r, st in states.items():
        path = folder / f"rank{r}.pt"
        torch.save(_flat(st), path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _torch_load(folder: Path, ranks: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: dict[int, RankState], b: dict[int, RankState]) -> bool:
    return all(
        torch.equal(_bits(x), _bits(_flat(b[r])[k])) for r in a for k, x in _flat(a[r]).items()
    )


def _save_rounds(
    tmp: Path, spec: ModelSpec, src: Layout, states: dict[int, RankState]
) -> dict[str, list[float]]:
    """Save times of ours and of ``torch.save``, ``SAVE_REPEATS`` rounds each after one
    untimed round of each.

    Both sides write a new copy while their previous one is kept (ours: ``keep=2``; the
    baseline: a new folder per round), and the copy before that is removed, untimed,
    right before each side's save: so both write into memory just freed by the same
    amount of their own files, and neither times a deletion.
    """
    saves: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(SAVE_REPEATS + 1):  # alternate, so both see the same disk weather
        shutil.rmtree(tmp / "ours" / f"step-{i - 2:08d}", ignore_errors=True)
        ours = _timed(
            functools.partial(
                save_checkpoint,
                tmp / "ours",
                layout=src,
                states=states,
                model=spec,
                allocation="fsdp:d2",
                step=i,
                optimizer="adam",
                keep=2,
                save_rng=False,
            )
        )
        shutil.rmtree(tmp / f"torch-{i - 2}", ignore_errors=True)
        base = _timed(functools.partial(_torch_save, states, tmp / f"torch-{i}"))
        if i:  # round 0 warms up
            saves["ours"].append(ours)
            saves["torch"].append(base)
    return saves


def _load_rounds(
    ours: Path, base: Path, src: Layout, dst: Layout
) -> tuple[dict[str, list[float]], dict[int, RankState]]:
    """Load times (same strategy and resharded, each with and without verification, and
    ``torch.load``), ``LOAD_REPEATS`` rounds each, and the states the same-strategy loads
    filled."""
    loads: dict[str, list[float]] = {k: [] for k in ("same", "same_nv", "torch", "re", "re_nv")}
    same, resharded = _blank(src), _blank(dst)
    runs: dict[str, Callable[[], Any]] = {
        "same_nv": lambda: load_checkpoint(
            ours, layout=src, states=same, optimizer="adam", verify=False
        ),
        "same": lambda: load_checkpoint(ours, layout=src, states=same, optimizer="adam"),
        "torch": lambda: _torch_load(base, src.world_size),
        "re_nv": lambda: load_checkpoint(
            ours, layout=dst, states=resharded, optimizer="adam", verify=False
        ),
        "re": lambda: load_checkpoint(ours, layout=dst, states=resharded, optimizer="adam"),
    }
    for _ in range(LOAD_REPEATS):
        for k, fn in runs.items():
            loads[k].append(_timed(fn))
    return loads, same


def _row(gb: float, name: str, s: float, ref: float | None = None) -> None:
    ratio = f"  speed x{ref / s:.2f} of torch" if ref else ""
    print(f"  {name:<48} {s:7.2f} s  {gb / s:6.2f} GB/s{ratio}")


def _report(
    gb: float,
    saves: dict[str, list[float]],
    loads: dict[str, list[float]],
    on_disk: int,
    base_disk: int,
) -> None:
    best = {k: min(v) for k, v in (saves | {f"load_{k}": v for k, v in loads.items()}).items()}
    base_save, base_load = best["torch"], best["load_torch"]
    print(
        f"best of {SAVE_REPEATS} saves (with fsync) and {LOAD_REPEATS} loads (files in the page cache)"
    )
    print(
        f"files: ours {on_disk / 1e9:.2f} GB (DCP + manifest), torch.save {base_disk / 1e9:.2f} GB"
    )
    _row(gb, "save_checkpoint (fsync, blake3, commit)", best["ours"], base_save)
    _row(gb, "torch.save + fsync", base_save)
    _row(gb, "load_checkpoint, same strategy, verified", best["load_same"], base_load)
    _row(gb, "load_checkpoint, same strategy, verify=False", best["load_same_nv"], base_load)
    _row(gb, "load_checkpoint, resharded to megatron:t2, verified", best["load_re"], base_load)
    _row(gb, "load_checkpoint, resharded, verify=False", best["load_re_nv"], base_load)
    _row(gb, "torch.load", base_load)
    print(
        f"  reshard-on-load / same-strategy load (both verify=False): "
        f"x{best['load_re_nv'] / best['load_same_nv']:.2f} the time"
    )
    paired = sorted(t / o for o, t in zip(saves["ours"], saves["torch"], strict=True))
    print(
        "  save rounds, each ours then torch.save back to back (speed x, sorted): "
        + ", ".join(f"{r:.2f}" for r in paired)
        + f"; median x{paired[len(paired) // 2]:.2f}"
    )
    print(
        f"  goals (speed, ours / torch; >= 1.0 meets it): save x{base_save / best['ours']:.2f}, "
        f"verified load x{base_load / best['load_same']:.2f}, verified resharded load "
        f"x{base_load / best['load_re']:.2f}"
    )


def run() -> None:
    spec = _model()
    src = _layout(spec, "fsdp:d2")
    dst = _layout(spec, "megatron:t2")
    states = _states(spec, src)
    nbytes = _nbytes(states)
    gb = nbytes / 1e9
    print(
        f"state: Qwen2.5-0.5B shape with {LAYERS} of 24 layers, {spec.num_params / 1e6:.0f}M parameters "
        f"(bf16) + Adam moments (fp32) = {gb:.2f} GB, layout fsdp:d2 (2 ranks in one process)"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=_scratch(3 * nbytes)))
    print(
        f"directory: {tmp.parent} ({'tmpfs: no disk in the figures' if tmp.parent == SHM else 'disk'})"
    )
    try:
        saves = _save_rounds(tmp, spec, src, states)
        ours = tmp / "ours" / f"step-{SAVE_REPEATS:08d}"
        base = tmp / f"torch-{SAVE_REPEATS}"
        on_disk = _warm(ours)
        base_disk = _warm(base)
        loads, same = _load_rounds(ours, base, src, dst)
        assert _same(same, states), "same-strategy load is not bitwise equal"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _report(gb, saves, loads, on_disk, base_disk)
