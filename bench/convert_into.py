"""One rank of the conversion benchmark loaded into existing tensors (an engine's parameters).

Part of ``python -m bench convert`` (:mod:`bench.bench_convert` runs it last, on the
same checkpoint and layout). The destination is rank 0's local tensors, allocated and
touched before timing, as an engine's parameters are. Two ways to fill it, checked
bitwise equal:

- ``old``: :func:`iter_to_megatron` over :meth:`HfCheckpoint.read` (each slice copied
  out of the file, each local tensor built new), then ``copy_`` into the destination:
  what the engines' ``load_canonical`` did with a reader;
- ``load_into``: :func:`~areal_fn.runtime.hf.load_into.load_into`, each piece read by
  ``preadv`` from the file straight into the destination's storage (single-threaded).

Baseline: ``memcpy``, a ``copy_`` of the same number of bytes into memory already
touched; ratios are against it. Each is measured with one torch thread and with the
default count: ``ROUNDS`` rounds, the three taking turns in each; the best time, and
the median over rounds of ``memcpy``'s time in that round over its own (the machine's
load moves both alike). Then one more run each, sampled for memory (the sampling thread
is not running while timing). Peak anonymous memory is
what the process allocates (the checkpoint's pages a rank maps are page cache, counted
in peak RSS only); it is compared with the largest single piece the rank holds.
"""

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from areal_fn.layouts.layout import Layout
from areal_fn.plans.convert import iter_to_megatron
from areal_fn.runtime.hf.io import HfCheckpoint
from areal_fn.runtime.hf.load_into import load_into
from bench.bench_convert import GB, Measured, _once

Targets = dict[str, torch.Tensor]


def _targets(layout: Layout, rank: int) -> Targets:
    """``rank``'s local tensors, allocated and touched (every page written)."""
    return {
        lt.name: torch.ones(lt.shape, dtype=torch.bfloat16) for lt in layout.local_tensors(rank)
    }


def _nbytes(targets: Targets) -> int:
    return sum(t.numel() * t.element_size() for t in targets.values())


def _largest_piece(layout: Layout, rank: int) -> int:
    """Bytes of the largest piece ``rank`` holds (bf16)."""
    return max(p.local_box.numel * 2 for lt in layout.local_tensors(rank) for p in lt.pieces)


def _old(ckpt_dir: Path, layout: Layout, out: Targets) -> Callable[[], int]:
    def old() -> int:
        with HfCheckpoint(ckpt_dir) as ckpt, torch.no_grad():
            for name, t in iter_to_megatron(ckpt.read, layout, 0):
                out[name].copy_(t)
        return _nbytes(out)

    return old


def _new(ckpt_dir: Path, layout: Layout, out: Targets) -> Callable[[], int]:
    def new() -> int:
        return load_into(ckpt_dir, layout, 0, out=out)

    return new


def _memcpy(nbytes: int) -> Callable[[], int]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults

    def memcpy() -> int:
        dst.copy_(src)
        return nbytes

    return memcpy


def _check_agreement(ckpt_dir: Path, layout: Layout) -> None:
    """``load_into`` writes bitwise what the old path writes, on poisoned destinations."""
    a, b = _targets(layout, 0), _targets(layout, 0)
    for t in b.values():
        t.fill_(float("nan"))
    _old(ckpt_dir, layout, a)()
    _new(ckpt_dir, layout, b)()
    assert list(a) == list(b)
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


ROUNDS = 7
MEMCPY = "memcpy (same bytes, touched)"


def _timed(fns: dict[str, Callable[[], int]]) -> dict[str, tuple[float, float]]:
    """Per function: best seconds and the median over ``ROUNDS`` of its ratio to the
    ``memcpy`` of the same round (speed of it / speed of memcpy; 1 for memcpy).

    The functions take turns within each round, so that load from other processes on a
    shared machine falls on all of them alike; the per-round ratio compares runs made
    seconds apart.
    """
    seconds: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(ROUNDS):
        for label, fn in fns.items():
            start = time.perf_counter()
            fn()
            seconds[label].append(time.perf_counter() - start)
    base = seconds[MEMCPY]
    return {
        k: (min(v), statistics.median(b / s for b, s in zip(base, v, strict=True)))
        for k, v in seconds.items()
    }


def _print(label: str, best: float, ratio: float, mem: Measured, piece: int) -> None:
    _, nbytes, rss, anon = mem
    gbs = nbytes / best / GB
    rss_s = f"{rss / GB:5.2f} GB" if rss >= 0 else "   n/a"
    print(
        f"    {label:<34} {nbytes / GB:5.2f} GB in {best:6.3f} s = {gbs:6.2f} GB/s  "
        f"{ratio:5.2f}x memcpy  peak RSS +{rss_s}  peak anon +{anon / GB:5.2f} GB "
        f"({anon / piece:4.2f}x largest piece)",
        flush=True,
    )


def run_into(ckpt_dir: Path, layout: Layout) -> None:
    """Measure and print loading rank 0 into existing tensors, old path vs ``load_into``."""
    _check_agreement(ckpt_dir, layout)
    out = _targets(layout, 0)
    nbytes, piece = _nbytes(out), _largest_piece(layout, 0)
    default = torch.get_num_threads()
    print(
        f"one rank into existing tensors (rank 0 of {layout.world_size}, {nbytes / GB:.2f} GB; "
        f"largest piece {piece / GB:.3f} GB; load_into == old path bitwise); best of {ROUNDS}, "
        "ratio: median over rounds of memcpy time / time:",
        flush=True,
    )
    fns = {
        MEMCPY: _memcpy(nbytes),
        "old (iter_to_megatron + copy_)": _old(ckpt_dir, layout, out),
        "load_into (preadv into the storage)": _new(ckpt_dir, layout, out),
    }
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        try:
            times = _timed(fns)
            mems = {k: _once(fn) for k, fn in fns.items()}  # memory: one sampled run each
        finally:
            torch.set_num_threads(default)
        print(f"  {threads} torch thread(s):", flush=True)
        for label, (best, ratio) in times.items():
            _print(label, best, ratio, mems[label], piece)
