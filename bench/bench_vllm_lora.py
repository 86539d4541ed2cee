"""A LoRA adapter update into a real vLLM (TP2, CPU) against a full weight update, in one run.

- **adapter** (:class:`~areal_fn.runtime.vllm.lora.VllmLoraSync`): the adapters alone, as
  a PEFT directory written atomically, which a vLLM started with ``enable_lora`` loads in
  place (``load_inplace``); bytes: the adapters' payload written;
- **merged**: ``merge_lora`` of the same adapters into the trainer's base weights, then a
  full update (``VllmWeightSync``, ``sharded`` mode) into a vLLM without LoRA;
- **full**: the full update alone (no merge), the same model.

The model is ``bench_vllm``'s (Qwen2 architecture, 4 layers, hidden 512, vocabulary
8000, fp32); the adapter targets every linear layer of the decoder layers at rank
``RANK``. Each vLLM is an offline ``vllm.LLM`` at TP2 in a process of its own; times are
medians of ``ROUNDS`` updates.

    .venv/bin/python -m bench vllm_lora      (runs itself in vLLM's Python, .venv-vllm)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = 5
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapters(spec: Any, config: Any, seed: int) -> dict[str, Any]:
    import torch

    from areal_fn.model.lora import lora_tensors

    g = torch.Generator().manual_seed(seed)
    return {s.name: 0.01 * torch.randn(s.shape, generator=g) for s in lora_tensors(spec, config)}


def _lora_config() -> Any:
    from areal_fn.model.lora import LoraConfig

    return LoraConfig(rank=RANK, alpha=2.0 * RANK, target_modules=TARGETS)


def _adapter_phase(root: Path) -> dict[str, Any]:
    from vllm import LLM

    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.vllm.lora import VllmLoraSync
    from bench.bench_vllm import CONFIG, _model_dir

    spec, config = model_from_hf_config(CONFIG), _lora_config()
    llm = LLM(
        model=str(_model_dir(root)),
        tensor_parallel_size=2,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=1,
    )
    sync = VllmLoraSync(llm, root / "adapters", spec, config)
    times, writes, loads, report = [], [], [], None
    for version in range(1, ROUNDS + 1):
        adapters = _adapters(spec, config, version)
        report = sync.update(version, adapters)
        times.append(report.seconds)
        writes.append(report.write_seconds)
        loads.append(report.load_seconds)
    assert report is not None
    del llm
    return {
        "seconds": statistics.median(times),
        "write_seconds": statistics.median(writes),
        "load_seconds": statistics.median(loads),
        "bytes": report.bytes_written,
        "bound": report.lower_bound,
    }


def _full_phase(root: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from areal_fn.plans.lora_export import merge_lora
    from bench.bench_vllm import _setup

    spec, engine, llm, sync = _setup(root)
    config = _lora_config()
    base = engine.export_canonical()
    rows: dict[str, Any] = {}
    version = 0
    for name in ("full", "merged"):
        times, report = [], None
        for _ in range(ROUNDS):
            version += 1
            t = time.perf_counter()
            if name == "merged":
                engine.load_canonical(merge_lora(spec, config, base, _adapters(spec, config, 1)))
            report = sync.update(version)
            times.append(time.perf_counter() - t)
        assert report is not None
        rows[name] = {
            "seconds": statistics.median(times),
            "bytes": report.bytes_sent,
            "bound": report.lower_bound,
        }
    dist.destroy_process_group()
    del llm
    return rows


def _phase(name: str, out: Path) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.setdefault("AREAL_FN_SYNC_SECRET", os.urandom(32).hex())
    root = Path(tempfile.mkdtemp(prefix=f"bench_vllm_lora_{name}_"))
    got = _adapter_phase(root) if name == "adapter" else _full_phase(root)
    out.write_text(json.dumps(got))


def run() -> None:
    """Each phase in vLLM's Python (``$AREAL_FN_VLLM_PYTHON``), then the table."""
    import importlib.util

    from areal_fn.model.lora import lora_param_count
    from areal_fn.model.spec import model_from_hf_config
    from bench.bench_vllm import CONFIG

    if importlib.util.find_spec("vllm") is None:
        from areal_fn.runtime.vllm.python import vllm_python

        python = vllm_python()
    else:
        python = sys.executable
    repo = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="bench_vllm_lora_"))
    rows: dict[str, Any] = {}
    for phase in ("adapter", "full"):
        out = tmp / f"{phase}.json"
        cmd = [python, "-m", "bench.bench_vllm_lora", "--phase", phase, "--out", str(out)]
        subprocess.run(cmd, cwd=repo, check=True, stdout=subprocess.DEVNULL)
        got = json.loads(out.read_text())
        rows.update({"adapter": got} if phase == "adapter" else got)
    spec, config = model_from_hf_config(CONFIG), _lora_config()
    model_bytes = sum(4 * t.numel for t in spec.tensors)
    print(
        f"qwen2 {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}: "
        f"{model_bytes / 2**20:.1f} MiB fp32; LoRA rank {RANK} on {len(TARGETS)} modules: "
        f"{lora_param_count(spec, config):,} parameters; vLLM TP2 (CPU), median of {ROUNDS}"
    )
    ours = rows["adapter"]["seconds"]
    print(f"{'update':<10}{'seconds':>9}{'x adapter':>11}{'bytes':>14}{'x bound':>9}")
    for name in ("adapter", "merged", "full"):
        r = rows[name]
        print(
            f"{name:<10}{r['seconds']:>9.3f}{r['seconds'] / ours:>11.1f}{r['bytes']:>14,}"
            f"{r['bytes'] / r['bound']:>9.2f}"
        )
    a = rows["adapter"]
    print(
        f"adapter: write {a['write_seconds'] * 1e3:.1f} ms, vLLM load {a['load_seconds'] * 1e3:.1f} "
        f"ms; bytes: adapter = payload written, merged/full = sent (bound from the layouts); "
        f"adapter/full = {a['bytes'] / rows['full']['bytes']:.4f}x bytes, "
        f"{a['seconds'] / rows['full']['seconds']:.3f}x time"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("adapter", "full"), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _phase(args.phase, Path(args.out))
