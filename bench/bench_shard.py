"""shard / unshard of a 1 GiB float32 tensor over 8 ranks vs a torch.chunk/torch.cat baseline.

For each sharding, times (best of ``REPEATS`` alternating rounds, one process, all 8
ranks' local tensors):

- ``shard``: :func:`areal_fn.sharding.shard.shard` for every rank, against the split
  ``distribute_tensor`` performs, hand-written: per mesh axis in order (each
  intermediate once), ``torch.chunk`` (``Shard``) or ``torch.chunk`` of every
  ``torch.chunk`` block then ``torch.cat`` (``StridedShard``), made contiguous at the
  end as ``shard`` returns it;
- ``unshard``: :func:`areal_fn.sharding.shard.unshard` of those locals, against ``torch.cat``
  of the same locals in the reverse order (the same full tensor).

Both sides produce bitwise-equal results (checked). Run: ``python -m bench shard``.
"""

import gc
import time
from collections.abc import Callable

import torch

from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Shard, StridedShard
from areal_fn.sharding.shard import shard, unshard
from areal_fn.sharding.sharding import Sharding

SIDE = 16384  # [16384, 16384] float32 = 1 GiB
REPEATS = 5


def _best_pair(ours: Callable[[], object], base: Callable[[], object]) -> tuple[float, float]:
    """Best time of each over ``REPEATS`` rounds, alternating so both see the same load."""
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for i, fn in enumerate((ours, base)):
            gc.collect()
            start = time.perf_counter()
            out = fn()
            best[i] = min(best[i], time.perf_counter() - start)
            del out
    return best[0], best[1]


# -- baseline: torch.chunk / torch.cat, mesh axis by mesh axis ------------------------
def _split_all(local: torch.Tensor, placement: object, n: int) -> list[torch.Tensor]:
    """All ``n`` parts of one axis's split of ``local`` (views where torch.chunk allows)."""
    if isinstance(placement, Shard):
        return list(torch.chunk(local, n, dim=placement.dim))
    if isinstance(placement, StridedShard):
        d = placement.dim
        blocks = [
            torch.chunk(b, n, dim=d) for b in torch.chunk(local, placement.split_factor, dim=d)
        ]
        return [torch.cat([b[c] for b in blocks], dim=d) for c in range(n)]
    return [local] * n


def baseline_shard(t: torch.Tensor, s: Sharding) -> list[torch.Tensor]:
    """Split axis by axis, each intermediate computed once (as a scatter tree would)."""
    mesh = s.mesh
    pieces: dict[tuple[int, ...], torch.Tensor] = {(): t}
    for p, n in zip(s.placements, mesh.sizes, strict=True):
        pieces = {
            key + (c,): part
            for key, local in pieces.items()
            for c, part in enumerate(_split_all(local, p, n))
        }
    return [pieces[mesh.coords(r)].contiguous() for r in range(mesh.size)]


def baseline_unshard(locals_: list[torch.Tensor], s: Sharding) -> torch.Tensor:
    """Undo the split axis by axis, last axis first (what an all-gather per axis does)."""
    mesh = s.mesh
    # Current pieces keyed by the coordinates of the axes not yet gathered.
    pieces = {mesh.coords(r): t for r, t in enumerate(locals_)}
    for axis in reversed(range(mesh.ndim)):
        p, n = s.placements[axis], mesh.sizes[axis]
        merged: dict[tuple[int, ...], torch.Tensor] = {}
        for key in sorted({k[:axis] + k[axis + 1 :] for k in pieces}):
            group = [pieces[key[:axis] + (c,) + key[axis:]] for c in range(n)]
            if isinstance(p, Shard):
                merged[key] = torch.cat(group, dim=p.dim)
            elif isinstance(p, StridedShard):
                k = p.split_factor
                parts = [torch.chunk(g, k, dim=p.dim) for g in group]
                merged[key] = torch.cat(
                    [parts[c][j] for j in range(k) for c in range(n)], dim=p.dim
                )
            else:
                merged[key] = group[0]
        pieces = merged
    return pieces[()]


CASES: tuple[tuple[str, Sharding], ...] = (
    ("Shard(0) over dp=8", Sharding(mesh=Mesh.of(dp=8), placements=(Shard(dim=0),))),
    ("Shard(1) over dp=8", Sharding(mesh=Mesh.of(dp=8), placements=(Shard(dim=1),))),
    (
        "(dp=2, tp=4): StridedShard(0, 4), Shard(0)",
        Sharding(
            mesh=Mesh.of(dp=2, tp=4),
            placements=(StridedShard(dim=0, split_factor=4), Shard(dim=0)),
        ),
    ),
)


def _time_case(t: torch.Tensor, s: Sharding) -> dict[str, tuple[float, float]]:
    ours = [shard(t, s, r) for r in range(s.mesh.size)]
    base = baseline_shard(t, s)
    assert all(torch.equal(a, b) for a, b in zip(ours, base, strict=True))
    del base
    full_ours, full_base = unshard(ours, s), baseline_unshard(ours, s)
    assert torch.equal(full_ours, t) and torch.equal(full_base, t)
    del full_ours, full_base
    return {
        "shard": _best_pair(
            lambda: [shard(t, s, r) for r in range(s.mesh.size)],
            lambda: baseline_shard(t, s),
        ),
        "unshard": _best_pair(lambda: unshard(ours, s), lambda: baseline_unshard(ours, s)),
    }


def run() -> None:
    t = torch.randn(SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    gib = t.numel() * t.element_size() / 2**30
    print(
        f"tensor [{SIDE}, {SIDE}] float32 = {gib:.0f} GiB, best of {REPEATS}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'sharding':44} {'op':8} {'ours ms':>9} {'base ms':>9} {'ours/base':>9}")
    for label, s in CASES:
        times = _time_case(t, s)
        gc.collect()
        for op, (a, b) in times.items():
            print(f"{label:44} {op:8} {a * 1e3:9.1f} {b * 1e3:9.1f} {a / b:9.2f}", flush=True)


if __name__ == "__main__":
    run()
