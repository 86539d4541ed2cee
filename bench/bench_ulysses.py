"""Ulysses sequence parallelism in the FSDP2 engine: activation memory and step time, c1 vs c2.

2 CPU processes under torchrun (gloo, one thread each), one launch; a Qwen2-shaped
model (hidden 64, 4 heads / 2 KV heads of 16, MLP 128, 2 layers, vocabulary 512,
fp32). At every sequence length ``T``, both engines are built in the same processes
and train on rows of ``T`` tokens:

- **c1** (``fsdp:d2``): each rank trains its own row of ``T`` tokens, whole;
- **c2** (``fsdp:c2``): both ranks train the same row, each ``T/2`` of its tokens, with
  attention all-to-all over the two ranks.

Activation memory per rank is measured, not estimated: the bytes of the distinct
storages autograd saves for backward during one forward (``saved_tensors_hooks``),
which is the peak of activations held (they are released during backward); the
model's parameters are under 1% of it. Step time is one ``train_step`` (forward,
backward, optimizer), the best of ``REPEATS``, the slower rank's. The memory ratio
c2 / c1 approaches ``1/cp = 0.5``: every per-token tensor holds ``T/2`` tokens and the
attention scores ``[heads/2, T, T]``. A c1 step trains twice the tokens of a c2 step
(two rows over the two ranks, against one).

Run: ``.venv/bin/python -m bench ulysses``.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORLD = 2
LENGTHS = (1024, 2048, 4096, 8192)
REPEATS = 2
CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "torch_dtype": "float32",
}


def saved_bytes(engine: Any, ids: Any) -> int:
    """Bytes of the distinct storages autograd saves during one ``train_step`` of ``ids``
    (all in its forward: nothing is recomputed)."""
    import torch

    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.train_step(ids)
    return total[0]


def measure(engine: Any, ids: Any) -> dict[str, float]:
    """Saved activation bytes of one ``train_step`` and its best time of ``REPEATS``
    (every rank starts each timed step together)."""
    import torch.distributed as dist

    mem = saved_bytes(engine, ids)
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(ids)
        times.append(time.perf_counter() - start)
    return {"bytes": mem, "seconds": min(times)}


def rows_for(t: int, vocab: int) -> Any:
    """The ``WORLD`` rows of ``t`` tokens both engines of a length train on."""
    import torch

    gen = torch.Generator().manual_seed(t)
    return torch.randint(0, vocab, (WORLD, t), generator=gen)


def print_table(recs: list[dict[str, Any]], lengths: tuple[int, ...] = LENGTHS) -> None:
    """c1 vs c2 per length: the larger rank's activations, the slower rank's step."""
    mib = 1 << 20
    print(
        f"{'T':>6}{'c1 act MiB':>12}{'c2 act MiB':>12}{'mem c2/c1':>11}"
        f"{'c1 step s':>11}{'c2 step s':>11}{'time c2/c1':>12}"
    )
    for t in lengths:
        m1 = max(r[f"c1/{t}"]["bytes"] for r in recs)
        m2 = max(r[f"c2/{t}"]["bytes"] for r in recs)
        s1 = max(r[f"c1/{t}"]["seconds"] for r in recs)
        s2 = max(r[f"c2/{t}"]["seconds"] for r in recs)
        print(
            f"{t:>6}{m1 / mib:>12.1f}{m2 / mib:>12.1f}{m2 / m1:>11.3f}"
            f"{s1:>11.2f}{s2:>11.2f}{s2 / s1:>12.3f}"
        )


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.strategy.parse import parse_allocation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    spec = model_from_hf_config(CONFIG)
    record: dict[str, Any] = {}
    engines = {
        c: Fsdp2Engine(spec, parse_allocation(text).training, grad_clip=None)
        for c, text in (("c1", "fsdp:d2"), ("c2", "fsdp:c2"))
    }
    for t in LENGTHS:
        rows = rows_for(t, spec.vocab_size)
        for c, engine in engines.items():
            record[f"{c}/{t}"] = measure(engine, rows[engine.dp_rank : engine.dp_rank + 1])
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all work is done


def run() -> None:
    from areal_fn.runtime.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="bench_ulysses_") as tmp:
        run_torchrun(
            Path(__file__),
            ["--worker", tmp],
            nproc=WORLD,
            timeout_s=1500,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        recs = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(
        "qwen2-shaped, hidden 64, 4 heads, 2 layers, fp32; 2 CPU processes (gloo); "
        "c1 = fsdp:d2 (each rank a whole row), c2 = fsdp:c2 (each rank half a row)"
    )
    print_table(recs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path, required=True)
    _worker(parser.parse_args().worker)
