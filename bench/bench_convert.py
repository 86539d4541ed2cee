"""HF -> Megatron conversion of a Qwen2.5-1.5B-shaped bf16 checkpoint on disk.

A random checkpoint with Qwen2.5-1.5B's shapes (hidden 1536, 28 layers, 12 heads, 2 KV
heads, intermediate 8960, vocab 151936, tied embeddings; 3.1 GB in bf16) is written
once to a temporary directory with :func:`write_hf_checkpoint` (1 GiB shards) and read
back warm from the page cache. The strategy is ``megatron:t2p2`` (4 ranks): Megatron
shards whole query groups, so with 2 KV heads ``t4`` is not a Megatron layout; ``t2p2``
gives each rank a quarter of the model, which is the point of the one-rank figure.

Three ways to produce the same local tensors (checked bitwise equal), best of
``REPEATS``:

- ``ours``: :func:`iter_to_megatron` over :meth:`HfCheckpoint.read` (memory-mapped
  slices: only the rows/columns a rank holds are read);
- ``ours, mmap views``: the same over zero-copy memory-mapped views of the shards
  (:func:`~areal_fn.runtime.hf.convert.read_local`): each byte is copied once;
- ``naive``: materialise each full logical tensor (the whole fused ``linear_qkv``, the
  whole padded embedding, ...) from whole canonical tensors, then chunk it for the rank
  (for all ranks: build it once, chunk it for every rank);
- ``copy``: ``clone()`` of an in-memory buffer holding the same number of bytes (a
  plain memory copy into fresh memory, page faults included, as every conversion pays
  them for its outputs); ratios are against this; ``memcpy`` (``copy_`` into memory
  already touched, no page faults) is printed as the hardware ceiling.

Per measurement: GB/s of local-tensor bytes produced, the ratio to ``copy``, and the
peak memory above the starting point (freed heap returned first with ``malloc_trim``):
peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs``; it includes the checkpoint
pages a rank maps, which are page cache the OS can drop) and peak anonymous memory
(``RssAnon`` sampled every millisecond: what the process itself allocates).
One rank's results are held until it is done (as a loader would); for all ranks each
rank's results are dropped once produced. Last, :mod:`bench.convert_into`: one rank
loaded into existing tensors (``load_into`` vs the old path, against ``memcpy``).
Run: ``python -m bench convert``.
"""

import ctypes
import gc
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from areal_fn.layouts.layout import Layout, LogicalTensor
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import iter_to_megatron
from areal_fn.runtime.hf.convert import read_local
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from areal_fn.sharding.box import Box
from areal_fn.sharding.placement import Placement, Shard, StridedShard
from areal_fn.strategy.allocation import ParallelDims

QWEN25_15B: dict[str, object] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
DIMS = ParallelDims(tp=2, pp=2)
REPEATS = 3
SHARD_BYTES = 1 << 30
GB = 1e9


# ------------------------------------------------------------------ memory


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _trim() -> None:
    """Return freed heap memory to the OS (glibc), so RSS deltas count live data only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _AnonPeak:
    """Samples ``RssAnon`` in a thread; ``peak`` is the largest value seen."""

    def __init__(self) -> None:
        self.peak = _status()["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status()["RssAnon"])
            time.sleep(0.001)

    def __enter__(self) -> "_AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status()["RssAnon"])


Measured = tuple[float, int, int, int]


def _once(fn: Callable[[], int]) -> Measured:
    """(seconds, bytes produced, peak RSS delta, peak anonymous delta) of one call."""
    gc.collect()
    _trim()
    exact = _reset_peak()
    before = _status()
    with _AnonPeak() as sampler:
        start = time.perf_counter()
        nbytes = fn()
        seconds = time.perf_counter() - start
    after = _status()
    rss = after["VmHWM"] - before["VmRSS"] if exact else -1
    return seconds, nbytes, rss, sampler.peak - before["RssAnon"]


def _measure(fns: dict[str, Callable[[], int]]) -> dict[str, Measured]:
    """Best time and largest peaks of each function over ``REPEATS`` rounds.

    The functions take turns within each round, so that load from other processes on a
    shared machine falls on all of them alike.
    """
    best: dict[str, Measured] = {}
    for _ in range(REPEATS):
        for label, fn in fns.items():
            s, n, rss, anon = _once(fn)
            if label in best:
                s0, _, rss0, anon0 = best[label]
                s, rss, anon = min(s, s0), max(rss, rss0), max(anon, anon0)
            best[label] = (s, n, rss, anon)
    return best


# ------------------------------------------------------------------ inputs


def _random_tensors(model: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    block = (torch.rand(1 << 22, generator=gen) * 0.04 - 0.02).to(torch.bfloat16)
    for i, spec in enumerate(model.tensors):
        t = torch.empty(spec.shape, dtype=torch.bfloat16)
        flat = t.view(-1)
        offset = (i * 7919) % block.numel()
        pos = 0
        while pos < flat.numel():  # a random block, tiled from a per-tensor offset
            piece = block[offset:] if pos == 0 else block
            n = min(piece.numel(), flat.numel() - pos)
            flat[pos : pos + n] = piece[:n]
            pos += n
        yield spec.name, t


def _warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def _view_reader(path: Path) -> Callable[[str, Box], torch.Tensor]:
    """A reader over zero-copy memory-mapped views of every shard (:func:`read_local`)."""
    views: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        views.update(read_local(f))

    def read(name: str, box: Box) -> torch.Tensor:
        return views[name][box.slices()]

    return read


# ------------------------------------------------------------------ naive


def _split(t: torch.Tensor, placement: Placement, n: int, c: int) -> torch.Tensor:
    if isinstance(placement, Shard):
        return torch.chunk(t, n, dim=placement.dim)[c]
    if isinstance(placement, StridedShard):
        blocks = torch.chunk(t, placement.split_factor, dim=placement.dim)
        return torch.cat([torch.chunk(b, n, dim=placement.dim)[c] for b in blocks], placement.dim)
    return t


def _full_logical(t: LogicalTensor, ckpt: HfCheckpoint) -> torch.Tensor:
    full = torch.zeros(t.shape, dtype=torch.bfloat16)
    for f in t.fusion:
        src = ckpt.read_full(f.canonical)[f.canonical_box.slices()]
        region = full[f.logical_box.slices()]
        region.copy_(src.reshape(region.shape))
        del src
    return full


def _naive_local(full: torch.Tensor, t: LogicalTensor, rank: int) -> torch.Tensor:
    mesh = t.sharding.mesh
    local = full
    for p, n, c in zip(t.sharding.placements, mesh.sizes, mesh.coords(rank), strict=True):
        local = _split(local, p, n, c)
    return local.clone()


def naive_rank(ckpt: HfCheckpoint, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for t in layout.tensors:
        if t.is_present(rank):
            out[t.name] = _naive_local(_full_logical(t, ckpt), t, rank)
    return out


# ------------------------------------------------------------------ run


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _row(label: str, m: tuple[float, int, int, int], copy_gbs: float | None) -> None:
    seconds, nbytes, rss, anon = m
    gbs = nbytes / seconds / GB
    ratio = f"{gbs / copy_gbs:5.2f}x copy" if copy_gbs else "          "
    rss_s = f"{rss / GB:6.2f} GB" if rss >= 0 else "     n/a"
    print(
        f"  {label:<28} {nbytes / GB:6.2f} GB in {seconds:6.2f} s = {gbs:6.2f} GB/s  {ratio}"
        f"  peak RSS +{rss_s}  peak anon +{anon / GB:6.2f} GB",
        flush=True,
    )


def _write_checkpoint(ckpt_dir: Path, model: ModelSpec, layout: Layout) -> None:
    """Write the random checkpoint and print what was written."""
    start = time.perf_counter()
    write_hf_checkpoint(ckpt_dir, _random_tensors(model), model=model, max_shard_bytes=SHARD_BYTES)
    size = sum(f.stat().st_size for f in ckpt_dir.glob("*.safetensors"))
    print(
        f"checkpoint: {model.num_params / 1e9:.2f} B params, {size / GB:.2f} GB bf16 in "
        f"{len(list(ckpt_dir.glob('*.safetensors')))} shards, written in "
        f"{time.perf_counter() - start:.1f} s; strategy megatron:{DIMS} "
        f"({layout.world_size} ranks), threads {torch.get_num_threads()}",
        flush=True,
    )


def _check_agreement(ckpt_dir: Path, layout: Layout) -> None:
    """Bitwise agreement of the conversions, rank 0."""
    with HfCheckpoint(ckpt_dir) as ckpt:
        ours0 = dict(iter_to_megatron(ckpt.read, layout, 0))
        naive0 = naive_rank(ckpt, layout, 0)
        views0 = dict(iter_to_megatron(_view_reader(ckpt_dir), layout, 0))
        for other in (naive0, views0):
            assert list(ours0) == list(other)
            assert all(torch.equal(ours0[k], other[k]) for k in ours0)
        del ours0, naive0, views0


def _copy_of(sizes: list[int]) -> Callable[[], int]:
    src = torch.ones(max(sizes), dtype=torch.uint8)  # freed with the closure

    def copy() -> int:
        total = 0
        for n in sizes:  # one fresh buffer per rank, dropped like a rank's state
            total += src[:n].clone().numel()
        return total

    return copy


def _memcpy_of(sizes: list[int]) -> Callable[[], int]:
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.zeros(max(sizes), dtype=torch.uint8)  # touched: no page faults

    def memcpy() -> int:
        for n in sizes:
            dst[:n].copy_(src[:n])
        return sum(sizes)

    return memcpy


def _ours_one(ckpt_dir: Path, layout: Layout) -> Callable[[], int]:
    def ours_one() -> int:
        with HfCheckpoint(ckpt_dir) as ckpt:
            state = dict(iter_to_megatron(ckpt.read, layout, 0))
            return _bytes(state)

    return ours_one


def _views_one(ckpt_dir: Path, layout: Layout) -> Callable[[], int]:
    def views_one() -> int:
        state = dict(iter_to_megatron(_view_reader(ckpt_dir), layout, 0))
        return _bytes(state)

    return views_one


def _views_all(ckpt_dir: Path, layout: Layout) -> Callable[[], int]:
    def views_all() -> int:
        read = _view_reader(ckpt_dir)
        return sum(
            _bytes(dict(iter_to_megatron(read, layout, r))) for r in range(layout.world_size)
        )

    return views_all


def _naive_one(ckpt_dir: Path, layout: Layout) -> Callable[[], int]:
    def naive_one() -> int:
        with HfCheckpoint(ckpt_dir) as ckpt:
            return _bytes(naive_rank(ckpt, layout, 0))

    return naive_one


def _ours_all(ckpt_dir: Path, layout: Layout) -> Callable[[], int]:
    def ours_all() -> int:
        total = 0
        with HfCheckpoint(ckpt_dir) as ckpt:
            for r in range(layout.world_size):
                total += _bytes(dict(iter_to_megatron(ckpt.read, layout, r)))
        return total

    return ours_all


def _naive_all(ckpt_dir: Path, layout: Layout) -> Callable[[], int]:
    def naive_all() -> int:
        total = 0
        with HfCheckpoint(ckpt_dir) as ckpt:
            for t in layout.tensors:
                full = _full_logical(t, ckpt)
                for r in range(layout.world_size):
                    if t.is_present(r):
                        total += _naive_local(full, t, r).numel() * 2
                del full
        return total

    return naive_all


Group = tuple[str, list[int], dict[str, Callable[[], int]]]


def _groups(ckpt_dir: Path, layout: Layout) -> list[Group]:
    """(title, bytes per rank, functions) for one rank and for all ranks."""
    rank_bytes = [
        sum(lt.numel * 2 for lt in layout.local_tensors(r)) for r in range(layout.world_size)
    ]
    return [
        (
            f"one rank (rank 0 of {layout.world_size}, {rank_bytes[0] / GB:.2f} GB):",
            [rank_bytes[0]],
            {
                "ours (iter_to_megatron)": _ours_one(ckpt_dir, layout),
                "ours, mmap views": _views_one(ckpt_dir, layout),
                "naive (full, then chunk)": _naive_one(ckpt_dir, layout),
            },
        ),
        (
            f"all {layout.world_size} ranks ({sum(rank_bytes) / GB:.2f} GB):",
            rank_bytes,
            {
                "ours (rank by rank)": _ours_all(ckpt_dir, layout),
                "ours, mmap views": _views_all(ckpt_dir, layout),
                "naive (full once, chunk x4)": _naive_all(ckpt_dir, layout),
            },
        ),
    ]


def _run_group(title: str, sizes: list[int], fns: dict[str, Callable[[], int]]) -> None:
    """Measure one group against ``copy`` and print its rows (``memcpy`` last)."""
    print(title, flush=True)
    ceiling = _measure({"memcpy (into touched memory)": _memcpy_of(sizes)})
    got = _measure({"copy (clone, same bytes)": _copy_of(sizes), **fns})
    copy = got["copy (clone, same bytes)"]
    copy_gbs = copy[1] / copy[0] / GB
    for label, m in {**got, **ceiling}.items():
        _row(label, m, None if m is copy else copy_gbs)


def run() -> None:
    torch.manual_seed(0)
    model = model_from_hf_config(QWEN25_15B)
    layout = megatron_layout(model, DIMS)
    root = Path(tempfile.mkdtemp(prefix="areal_fn_bench_convert_"))
    try:
        ckpt_dir = root / "Qwen2.5-1.5B-random"
        _write_checkpoint(ckpt_dir, model, layout)
        _warm(ckpt_dir)
        _check_agreement(ckpt_dir, layout)
        for title, sizes, fns in _groups(ckpt_dir, layout):
            _run_group(title, sizes, fns)
        from bench.convert_into import run_into  # it imports this module

        run_into(ckpt_dir, layout)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run()
