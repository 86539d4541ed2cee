"""The vLLM side of ``test_vllm_lora.py``, in vLLM's Python (no PEFT there).

``python -m tests.vllm.lora_worker --phase adapter|merged --work DIR --out FILE``; ``DIR``
holds the served model (``hf/``), the adapter configuration (``lora.json``) and two
adapter versions (``adapters_v1.safetensors``, ``adapters_v2.safetensors``), written by
the test. Every generation is greedy from :data:`PROMPTS`; each records its tokens and
vLLM's log-probs of them, which the test scores with transformers + PEFT.

- ``adapter``: a vLLM with ``enable_lora`` (TP2); ``VllmLoraSync`` serves version 1,
  then version 2; a version vLLM would refuse (rank 16 > ``max_lora_rank`` 8) is
  refused and leaves version 2 served; version 4 (version 1's adapters) then loads;
  version 5 is a LoRA trainer's (``Fsdp2Engine(lora=...)``, one step, ``export_adapters``),
  scored against the trainer's own log-probs; the base model (no adapter) is generated
  too.
- ``merged``: a vLLM without LoRA (TP2, the ``areal_fn`` backend); a one-rank trainer
  (``fsdp:d1``, this process) holds ``merge_lora(base, adapters_v2)`` and updates it
  with ``VllmWeightSync``.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

#: the second prompt fills a cache block (``BLOCK`` tokens) and more: requests with an
#: adapter version would hit the blocks an earlier version left, were the keys the same
BLOCK = 32
PROMPTS = [[5, 17, 42, 7], [(7 * i + 3) % 500 for i in range(BLOCK + 8)]]
TOKENS = 6


def generate(llm: Any, lora_request: Any = None) -> list[dict[str, list[Any]]]:
    from vllm import SamplingParams

    done = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=TOKENS, logprobs=0, temperature=0, detokenize=False),
        use_tqdm=False,
        lora_request=lora_request,
    )
    out = []
    for d in done:
        o = d.outputs[0]
        tokens = list(o.token_ids)
        lps = [lp[t].logprob for lp, t in zip(o.logprobs, tokens, strict=True)]
        out.append({"tokens": tokens, "logprobs": lps})
    return out


def _setup(work: Path) -> tuple[Any, Any, dict[int, Any]]:
    from safetensors.torch import load_file

    from areal_fn.model.lora import LoraConfig
    from areal_fn.model.spec import model_from_hf_config

    spec = model_from_hf_config(json.loads((work / "hf" / "config.json").read_text()))
    config = LoraConfig(**json.loads((work / "lora.json").read_text()))
    versions = {v: load_file(str(work / f"adapters_v{v}.safetensors")) for v in (1, 2)}
    return spec, config, versions


def adapter_phase(work: Path) -> dict[str, Any]:
    import attrs
    import torch
    from vllm import LLM

    from areal_fn.model.lora import LoraError, lora_tensors
    from areal_fn.runtime.vllm.lora import VllmLoraSync

    spec, config, versions = _setup(work)
    llm = LLM(
        model=str(work / "hf"),
        tensor_parallel_size=2,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
        block_size=BLOCK,
        enable_prefix_caching=True,
    )
    sync = VllmLoraSync(llm, work / "served", spec, config, name="policy")
    out: dict[str, Any] = {"versions": {}}
    for v, adapters in versions.items():
        report = sync.update(v, adapters)
        listing = sorted(p.name for p in (work / "served" / "policy").iterdir())
        gen = generate(llm, sync.lora_request)
        out["versions"][str(v)] = {**attrs.asdict(report), "listing": listing, "gen": gen}
    # a version over vLLM's max_lora_rank: refused before anything is written or sent
    wide = attrs.evolve(config, rank=16)
    g = torch.Generator().manual_seed(9)
    big = {s.name: torch.randn(s.shape, generator=g) for s in lora_tensors(spec, wide)}
    try:
        VllmLoraSync(llm, work / "served", spec, wide, name="policy").update(3, big)
        out["refused"] = None
    except LoraError as e:
        out["refused"] = str(e)
    out["refused_left"] = sorted(p.name for p in (work / "served" / "policy").iterdir())
    out["after_refused"] = generate(llm, sync.lora_request)
    # the next version loads (vLLM's replies to later calls are not out of step)
    path = sync.update(4, versions[1]).path
    listing = sorted(p.name for p in (work / "served" / "policy").iterdir())
    gen = generate(llm, sync.lora_request)
    out["version_4_is_1"] = {"path": path, "listing": listing, "gen": gen}
    out["trainer"] = trainer_update(llm, sync, spec, config, work)
    out["base"] = generate(llm)
    del llm
    return out


def trainer_update(llm: Any, sync: Any, spec: Any, config: Any, work: Path) -> dict[str, Any]:
    """A LoRA trainer (``Fsdp2Engine(lora=...)``, ``fsdp:d1``, this process) on the served
    base trains one step, exports its adapters (``export_adapters``) and serves them as
    version 5: the largest gap between vLLM's log-probs and the trainer's own."""
    import socket

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.strategy.allocation import ParallelDims

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    engine = Fsdp2Engine(spec, ParallelDims(dp=1), seed=5, lora=config)
    engine.load_canonical(load_file(str(work / "hf" / "model.safetensors")))
    batch = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.train_step(batch)  # lora_B leaves zero: the adapters change the outputs
    adapters = engine.export_adapters()
    report = sync.update(5, adapters)
    save_file(adapters, str(work / "trainer_adapters.safetensors"))
    gap = 0.0
    for prompt, g in zip(PROMPTS, generate(llm, sync.lora_request), strict=True):
        want = engine.forward_logprobs(torch.tensor([prompt + g["tokens"]]))[0, len(prompt) - 1 :]
        gap = max(gap, *(abs(a - float(b)) for a, b in zip(g["logprobs"], want, strict=True)))
    dist.destroy_process_group()
    return {
        "gap": gap,
        "path": report.path,
        "bytes_written": report.bytes_written,
        "lower_bound": report.lower_bound,
    }


def merged_phase(work: Path) -> dict[str, Any]:
    import socket

    import torch.distributed as dist
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from areal_fn.plans.lora_export import merge_lora
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.runtime.vllm.trainer import VllmWeightSync
    from areal_fn.strategy.allocation import ParallelDims

    spec, config, versions = _setup(work)
    base = load_file(str(work / "hf" / "model.safetensors"))
    llm = LLM(
        model=str(work / "hf"),
        tensor_parallel_size=2,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        weight_transfer_config=WeightTransferConfig(backend="areal_fn"),
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    engine = Fsdp2Engine(spec, ParallelDims(dp=1), seed=5)
    engine.load_canonical(merge_lora(spec, config, base, versions[2]))
    report = VllmWeightSync(engine, llm).update(1)
    out = {
        "bytes_sent": report.bytes_sent,
        "lower_bound": report.lower_bound,
        "mode": report.mode,
        "gen": generate(llm),
    }
    dist.destroy_process_group()
    del llm
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("adapter", "merged"), required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    got = adapter_phase(work) if args.phase == "adapter" else merged_phase(work)
    Path(args.out).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("AREAL_FN_SYNC_SECRET", os.urandom(32).hex())
    sys.exit(main())
