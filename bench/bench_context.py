"""Context parallelism in the Megatron engine: activation memory and step time, c1 vs c2.

The counterpart of :mod:`bench.bench_ulysses` for ``MegatronEngine``: the same 2 CPU
processes (gloo, one thread each), the same Qwen2-shaped model and rows, one launch.
At every sequence length ``T`` each engine trains on rows of ``T`` tokens:

- **c1** (``megatron:d2``): each rank trains its own row of ``T`` tokens, whole
  (Megatron-Core's local ``DotProductAttention``);
- **c2** (``megatron:c2``): both ranks train the same row; each runs chunks ``r`` and
  ``3 - r`` of its 4 chunks (Megatron's load-balanced split), ``T/2`` tokens, with the
  core attention of :mod:`areal_fn.runtime.megatron.context` (K and V all-gathered).

Megatron's ``parallel_state`` is global, so the c1 engine runs every length, is
closed, then the c2 engine runs every length (same processes). Activation memory per
rank is the bytes of the distinct storages autograd saves in one ``train_step``
(:func:`bench.bench_ulysses.saved_bytes`); step time is one ``train_step``, the best
of ``REPEATS``, the slower rank's. A c1 step trains twice the tokens of a c2 step.

Run: ``.venv/bin/python -m bench context``.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ulysses import CONFIG, LENGTHS, WORLD, measure, print_table, rows_for  # noqa: E402

STRATEGIES = (("c1", "megatron:d2"), ("c2", "megatron:c2"))


def _worker(out: Path, lengths: tuple[int, ...]) -> None:
    import torch
    import torch.distributed as dist

    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.engines.megatron import MegatronEngine
    from areal_fn.strategy.parse import parse_allocation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    spec = model_from_hf_config(CONFIG)
    record: dict[str, Any] = {}
    for c, text in STRATEGIES:
        with MegatronEngine(spec, parse_allocation(text).training, grad_clip=None) as engine:
            for t in lengths:
                rows = rows_for(t, spec.vocab_size)
                record[f"{c}/{t}"] = measure(engine, rows[engine.dp_rank : engine.dp_rank + 1])
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all work is done


def run(lengths: tuple[int, ...] = LENGTHS) -> None:
    from areal_fn.runtime.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="bench_context_") as tmp:
        run_torchrun(
            Path(__file__),
            ["--worker", tmp, "--lengths", ",".join(map(str, lengths))],
            nproc=WORLD,
            timeout_s=2400,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        recs = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(
        "qwen2-shaped, hidden 64, 4 heads, 2 layers, fp32; 2 CPU processes (gloo); "
        "c1 = megatron:d2 (each rank a whole row), c2 = megatron:c2 (each rank 2 of 4 chunks)"
    )
    print_table(recs, lengths)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path, required=True)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = parser.parse_args()
    _worker(args.worker, tuple(int(t) for t in args.lengths.split(",")))
