"""HF safetensors -> a Megatron ``GPTModel``'s parameters: ours against mbridge.

mbridge (``mbridge==0.15.1``, the dev extra) is the HF <-> Megatron bridge AReaL uses
by default. Both sides fill the parameters of the same ``GPTModel`` (Megatron-Core,
CPU, local layer spec, bf16 parameters, fp32 norms, built by
:mod:`areal_fn.runtime.megatron.build` under our CPU redirections) from the same HF
checkpoint (one ``model.safetensors``, bf16, random values, the page cache warm):

- **ours**: :func:`~areal_fn.runtime.hf.load_into.load_into` of the rank's local
  tensors of :func:`~areal_fn.layouts.megatron.megatron_layout`, straight into the
  parameters (``cast=True``: the norms are fp32);
- **mbridge**: ``Qwen2Bridge.load_weights([model], checkpoint)``: tensor-parallel rank
  0 reads every tensor it needs (``safe_open``), fuses and pads it, and scatters each
  rank's part over the tensor-parallel group (gloo here); every rank copies it in.

mbridge's name tables are those of Transformer Engine's layer spec, where the norms
live inside ``linear_qkv`` and ``linear_fc1``; Transformer Engine is not on this
machine, so the model has the local spec's ``input_layernorm`` and
``pre_mlp_layernorm``. The benchmark adds those two names to mbridge's tables (a
subclass; nothing it times changes). mbridge's vocabulary padding is set to
Megatron's (multiple of 128 x tp) so that both sides fill the same padded embedding.

Two phases in one torchrun launch of 2 CPU processes (gloo, one thread each): **t1**,
the whole model on one rank (rank 0 loads, rank 1 waits), and **t2**, tensor
parallelism over both ranks. Per phase, ``ROUNDS`` rounds, the two sides taking turns,
each from zeroed parameters; wall time barrier to barrier; after every round of each
side every parameter is compared bitwise with what ours wrote.

Run: ``.venv/bin/python -m bench mbridge``.
"""

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402

MODEL = ROOT / "specs" / "models" / "Qwen2.5-0.5B.json"
LAYERS = 8
ROUNDS = 5
WORLD = 2


def config() -> dict[str, Any]:
    """The benchmark's HF config: Qwen2.5-0.5B with ``LAYERS`` layers."""
    return {**json.loads(MODEL.read_text()), "num_hidden_layers": LAYERS}


def spec() -> ModelSpec:
    return model_from_hf_config(config())


def _write_checkpoint(folder: Path) -> int:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        t.name: torch.empty(t.shape).uniform_(-1, 1, generator=gen).to(torch.bfloat16)
        for t in spec().tensors
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config()))
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ----------------------------------------------------------------------------- worker
def _bridge(vocab: int, padded: int) -> Any:
    """mbridge's Qwen2 bridge with the local spec's two norm names added."""
    import torch
    from mbridge.models.qwen2 import Qwen2Bridge
    from transformers import Qwen2Config

    norm = "model.layers.{layer_number}.post_attention_layernorm.weight"

    class LocalSpecQwen2Bridge(Qwen2Bridge):  # type: ignore[misc]
        _MLP_MAPPING: ClassVar = {**Qwen2Bridge._MLP_MAPPING, "pre_mlp_layernorm.weight": [norm]}
        _OTHER_MAPPING: ClassVar = {
            "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]
        }

    fields = {k: v for k, v in config().items() if k not in ("architectures", "model_type")}
    bridge = LocalSpecQwen2Bridge(Qwen2Config(**fields), dtype=torch.bfloat16)
    bridge.make_vocab_size_divisible_by = 128
    bridge.vocab_size, bridge.padded_vocab_size = vocab, padded
    return bridge


def _phase(ckpt: Path, tp: int, active: bool) -> dict[str, Any]:
    """One strategy: build the model, time both loaders in turns, compare bitwise."""
    import torch
    import torch.distributed as dist

    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.layouts.vocab import padded_vocab_size
    from areal_fn.runtime.hf.load_into import load_into
    from areal_fn.runtime.megatron.build import (
        MegatronSizes,
        build_gpt_model,
        megatron_session,
        transformer_config,
    )
    from areal_fn.runtime.megatron.config import arch_of
    from areal_fn.strategy.allocation import ParallelDims

    s, rank = spec(), dist.get_rank()
    sizes = MegatronSizes(tp=tp)
    dims = ParallelDims(tp=tp) if tp > 1 else ParallelDims(dp=WORLD)
    with megatron_session(sizes):
        arch = arch_of(s)
        padded = padded_vocab_size(s.vocab_size, tp=tp)
        gpt = build_gpt_model(
            arch,
            transformer_config(arch, sizes, params_dtype=torch.bfloat16),
            vocab_size=padded,
        )
        layout = megatron_layout(s, dims)
        params = dict(gpt.named_parameters())
        out = {lt.name: params[lt.name].data for lt in layout.local_tensors(rank)}
        bridge = _bridge(s.vocab_size, padded)

        def ours() -> None:
            load_into(ckpt, layout, rank, out=out, cast=True)

        def theirs() -> None:
            bridge.load_weights([gpt], str(ckpt))

        fns: dict[str, Callable[[], None]] = {"ours": ours, "mbridge": theirs}
        times: dict[str, list[float]] = {n: [] for n in fns}
        want: dict[str, torch.Tensor] = {}
        equal = True
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                with torch.no_grad():
                    for p in params.values():
                        p.zero_()
                dist.barrier()
                start = time.perf_counter()
                if active:
                    with torch.no_grad():
                        fn()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                if not active:
                    continue
                if not want:
                    want = {n: p.detach().clone() for n, p in params.items()}
                equal &= all(
                    torch.equal(p.detach().view(torch.uint8), want[n].view(torch.uint8))
                    for n, p in params.items()
                )
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
    return {"times": times, "equal": equal, "param_bytes": nbytes, "active": active}


def _worker(ckpt: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    record = {
        "t1": _phase(ckpt, 1, active=rank == 0),
        "t2": _phase(ckpt, 2, active=True),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def _report(recs: list[dict[str, Any]], ckpt_bytes: int) -> None:
    s = spec()
    print(
        f"model: Qwen2.5-0.5B shape, {s.num_layers} layers, bf16 checkpoint "
        f"{ckpt_bytes / 2**20:.0f} MiB (one model.safetensors, page cache warm); "
        f"Megatron GPTModel, local spec, CPU; {WORLD} processes, gloo, 1 thread each; "
        f"{ROUNDS} rounds, the sides in turns"
    )
    print(f"{'phase':<6}{'side':<9}{'best s':>8}{'median s':>10}   rounds")
    for phase in ("t1", "t2"):
        per = {
            side: [max(r[phase]["times"][side][i] for r in recs) for i in range(ROUNDS)]
            for side in ("ours", "mbridge")
        }
        for side, ts in per.items():
            rounds = ", ".join(f"{t:.3f}" for t in ts)
            print(f"{phase:<6}{side:<9}{min(ts):>8.3f}{statistics.median(ts):>10.3f}   {rounds}")
        paired = sorted(m / o for m, o in zip(per["mbridge"], per["ours"], strict=True))
        equal = all(r[phase]["equal"] for r in recs if r[phase]["active"])
        mib = recs[0][phase]["param_bytes"] / 2**20
        print(
            f"{phase}: mbridge / ours: {min(per['mbridge']) / min(per['ours']):.2f}x best "
            f"against best, per round {', '.join(f'{r:.2f}' for r in paired)}x, median "
            f"{statistics.median(paired):.2f}x (> 1: ours faster); rank 0's parameters "
            f"{mib:.0f} MiB; every parameter bitwise equal: {equal}"
        )


def run() -> None:
    import importlib.util

    from areal_fn.runtime.launch import run_torchrun

    if importlib.util.find_spec("mbridge") is None:
        print(
            "mbridge is not installed: pip install -c constraints.txt 'mbridge[megatron]==0.15.1'"
        )
        return
    with tempfile.TemporaryDirectory(prefix="bench_mbridge_") as tmp:
        ckpt, out = Path(tmp) / "hf", Path(tmp) / "out"
        ckpt.mkdir()
        out.mkdir()
        ckpt_bytes = _write_checkpoint(ckpt)
        run_torchrun(
            Path(__file__),
            ["--worker", str(ckpt), str(out)],
            nproc=WORLD,
            timeout_s=900,
            cwd=ROOT,
            env={"OMP_NUM_THREADS": "1"},
        )
        recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    _report(recs, ckpt_bytes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(*args.worker)
    else:
        run()
