"""The main job's rollout engine: a real vLLM server (TP2) the trainers feed.

The driver writes a model directory for the demo's model (random weights, which the
first update replaces, and a word-level tokenizer with one token per id, so that the
OpenAI server answers ``/v1/completions``), starts ``vllm.entrypoints.openai.api_server``
with the ``areal_fn`` weight-transfer backend while the job trains, and stops it at the
end. The worker's stage (:func:`stage_vllm`) updates vLLM from a training engine
(:class:`~areal_fn.runtime.vllm.trainer.VllmWeightSync`), lets it generate greedily,
and compares vLLM's log-probs of its tokens with the trainer's.
"""

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_fn.runtime.vllm.python import vllm_python

__all__ = ["VLLM_TP", "VllmServer", "stage_vllm", "write_served_model"]

#: The demo's vLLM deployment: TP2 (on this 2-core machine, one core per rank).
VLLM_TP = 2
#: The prompt the demo's vLLM completes (token ids).
PROMPT = [5, 17, 42, 7, 99, 3]
#: vLLM's CPU kernels against the trainer's (fp32): measured below 1e-6.
LOGPROB_TOL = 2e-5


def write_served_model(path: Path, config: dict[str, Any], *, seed: int = 0) -> Path:
    """Random weights of ``config`` (transformers), the config and a tokenizer in ``path``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32
    )
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {f"t{i}": i for i in range(int(config["vocab_size"]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", eos_token="t1"
    )
    fast.save_pretrained(path)
    return path


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` with the ``areal_fn`` backend."""

    def __init__(self, model: Path, *, secret: str, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(VLLM_TP)))
        env.update(VLLM_SERVER_DEV_MODE="1", AREAL_FN_SYNC_SECRET=secret)
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [
                vllm_python(),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--tensor-parallel-size",
                str(VLLM_TP),
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "256",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--weight-transfer-config",
                json.dumps({"backend": "areal_fn"}),
            ],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


def wait_ready(url: str, *, timeout_s: float = 300.0) -> None:
    """Wait for the server's ``/health`` (raises ``RuntimeError`` after ``timeout_s``)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the vLLM server at {url} did not answer /health within {timeout_s}s")


def _generate(url: str, model: str) -> tuple[list[int], list[float]]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        lp = json.loads(r.read())["choices"][0]["logprobs"]
    tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    return tokens, [float(x) for x in lp["token_logprobs"]]


def stage_vllm(
    engine: Any,
    url: str,
    model: str,
    version: int,
    what: str,
    record: Callable[[str, bool, str], None],
) -> None:
    """Update vLLM from ``engine`` as ``version``, generate, compare log-probs (collective)."""
    import torch
    import torch.distributed as dist

    from areal_fn.runtime.vllm.trainer import VllmWeightSync

    rank = dist.get_rank()
    if rank == 0:
        wait_ready(url)
    dist.barrier()
    sync = VllmWeightSync(engine, url, timeout_s=60.0)
    report = sync.update(version)
    got: list[Any] = [None, None]
    if rank == 0:
        got = list(_generate(url, model))
    dist.broadcast_object_list(got, src=0)
    tokens, vllm_lp = got
    want = engine.forward_logprobs(torch.tensor([PROMPT + tokens]))[0, len(PROMPT) - 1 :]
    diff = float((torch.tensor(vllm_lp) - want.float()).abs().max())
    sync.close()
    record(
        f"weight sync {what} -> vLLM t{VLLM_TP} (real engine)",
        report.bytes_sent == report.lower_bound
        and diff <= LOGPROB_TOL
        and report.weight_version == str(version),
        f"v{version}, {report.buckets} buckets, {report.bytes_sent} B over the wire "
        f"(= lower bound {report.lower_bound} B from the layouts); vLLM generated "
        f"{len(tokens)} tokens, its log-probs = the trainer's within {diff:.1e} "
        f"(tolerance {LOGPROB_TOL:.0e}); vLLM reports version {report.weight_version}",
    )
