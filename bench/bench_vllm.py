"""A weight update into a real vLLM (TP2, CPU), three ways, in one run.

- **ours** (``mode="sharded"``): each vLLM rank receives the canonical boxes its own
  parameters are made of (``vllm_layout``), loaded through vLLM's layerwise reload;
- **full tensors** (``mode="full"``): the path AReaL and vLLM's ``nccl`` backend take:
  the trainer gathers whole tensors (``export_canonical``), every vLLM rank receives
  every tensor whole and vLLM's own loaders cut its part (the same transport and
  reload, so the difference is the bytes and the loading);
- **disk**: the trainer writes an HF checkpoint (safetensors) and vLLM reloads it
  (``reload_weights(weights_path=...)``, vLLM's own).

The trainer is one process (``fsdp:d1``, gloo) beside an offline ``vllm.LLM`` at TP2;
times are medians of ``ROUNDS`` updates; bytes are payload bytes the trainer sent. The
last line gives each update as a fraction of one vLLM decode step of this model (the
median step of a greedy generation of ``DECODE`` tokens).

    .venv/bin/python -m bench vllm      (runs itself in vLLM's Python, .venv-vllm)
"""

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = 3
DECODE = 32
CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 8000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _model_dir(root: Path) -> Path:
    import torch
    import transformers

    path = root / "served"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**CONFIG), dtype=torch.float32
    )
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def _decode_step(llm: Any) -> float:
    from vllm import SamplingParams

    def gen(n: int) -> float:
        t = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": list(range(1, 17))}],
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        return time.perf_counter() - t

    gen(DECODE)  # warm
    return (statistics.median(gen(DECODE + 1) for _ in range(3)) - gen(1)) / DECODE


def run() -> None:
    """In this Python when it has vLLM, else in vLLM's (``$AREAL_FN_VLLM_PYTHON``)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is None:
        from areal_fn.runtime.vllm.python import vllm_python

        repo = Path(__file__).resolve().parents[1]
        subprocess.run([vllm_python(), "-m", "bench.bench_vllm"], cwd=repo, check=True)
        return
    _run()


def _run() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.setdefault("AREAL_FN_SYNC_SECRET", os.urandom(32).hex())
    import torch.distributed as dist

    root = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    spec, engine, llm, sync = _setup(root)
    rows = _updates(engine, sync)
    rows["disk"] = _disk(engine, llm, root / "disk")
    _report(spec, rows, _decode_step(llm))
    dist.destroy_process_group()
    del llm


def _setup(root: Path) -> tuple[Any, Any, Any, Any]:
    """The trainer (``fsdp:d1``, this process) and an offline vLLM at TP2, connected."""
    import socket

    import torch.distributed as dist
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.runtime.vllm.trainer import VllmWeightSync
    from areal_fn.strategy.allocation import ParallelDims

    served = _model_dir(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    spec = model_from_hf_config(CONFIG)
    engine = Fsdp2Engine(spec, ParallelDims(dp=1), seed=1)
    llm = LLM(
        model=str(served),
        tensor_parallel_size=2,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        weight_transfer_config=WeightTransferConfig(backend="areal_fn"),
    )
    return spec, engine, llm, VllmWeightSync(engine, llm, bucket_bytes=16 << 20)


def _updates(engine: Any, sync: Any) -> dict[str, tuple[float, int, int]]:
    """Median seconds, bytes sent and bound of ``ROUNDS`` updates in each mode."""
    rows: dict[str, tuple[float, int, int]] = {}
    version = 0
    for mode in ("sharded", "full"):
        times, sent, bound = [], 0, 0
        for _ in range(ROUNDS):
            version += 1
            t = time.perf_counter()
            if mode == "full":
                engine.export_canonical()  # the gather those paths make on the trainer
            report = sync.update(version, mode=mode)
            times.append(time.perf_counter() - t)
            sent, bound = report.bytes_sent, report.lower_bound
        rows[mode] = (statistics.median(times), sent, bound)
    return rows


def _disk(engine: Any, llm: Any, disk: Path) -> tuple[float, int, int]:
    """Median seconds of: gather, write an HF checkpoint, vLLM reloads it."""
    from safetensors.torch import save_file

    times = []
    written = 0
    for _ in range(ROUNDS):
        t = time.perf_counter()
        canonical = engine.export_canonical()
        disk.mkdir(exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in canonical.items()}, str(disk / "model.safetensors")
        )
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(disk)})
        times.append(time.perf_counter() - t)
        written = (disk / "model.safetensors").stat().st_size
    return statistics.median(times), written, 0


def _report(spec: Any, rows: dict[str, tuple[float, int, int]], step: float) -> None:
    model_bytes = sum(4 * t.numel for t in spec.tensors)
    ours, bound = rows["sharded"][0], rows["sharded"][2]
    print(
        f"qwen2 {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}: "
        f"{model_bytes / 2**20:.1f} MiB fp32; trainer fsdp:d1 -> vLLM TP2 (CPU), "
        f"median of {ROUNDS}"
    )
    print(f"{'path':<14}{'seconds':>9}{'x ours':>9}{'bytes':>14}{'x bound':>9}{'x one step':>12}")
    for name, key in (("ours", "sharded"), ("full tensors", "full"), ("disk reload", "disk")):
        sec, sent, _ = rows[key]
        print(
            f"{name:<14}{sec:>9.3f}{sec / ours:>9.2f}{sent:>14,}{sent / bound:>9.2f}"
            f"{sec / step:>12.1f}"
        )
    print(
        f"bytes: sent over the wire (disk reload: the file written); bound: {bound:,} B from "
        f"the layouts; one vLLM decode step: {step * 1e3:.1f} ms; ours/full = "
        f"{ours / rows['full'][0]:.2f}x time, {rows['sharded'][1] / rows['full'][1]:.2f}x bytes"
    )


if __name__ == "__main__":
    _run()
