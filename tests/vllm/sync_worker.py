"""A torchrun trainer feeding a real vLLM server (``test_vllm_sync.py`` starts both).

Every step: a training step, a weight update into vLLM (:class:`VllmWeightSync`),
vLLM generates greedily from a prompt, and the trainer scores the same tokens; rank 0
records vLLM's log-probs, the trainer's, the bytes against the bound and vLLM's
``/weight_checker`` checksums. ``--fault`` runs one refusal instead
(``stale``: an update to an old version; ``kill``: rank 1 dies in the middle of an
update). At the end rank 0 exports the final weights as an HF checkpoint.
"""

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PROMPT = [5, 17, 42, 7, 99, 3]


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def generate(url: str, model: str) -> tuple[list[int], list[float]]:
    got = post(
        url,
        "/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    )
    lp = got["choices"][0]["logprobs"]
    tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    return tokens, [float(x) for x in lp["token_logprobs"]]


def build_engine(strategy: str, spec: Any) -> Any:
    from areal_fn.strategy.parse import parse_allocation

    component = parse_allocation(strategy).components[0]
    if component.backend.value == "megatron":
        from areal_fn.runtime.engines.megatron import MegatronEngine

        return MegatronEngine(spec, component, seed=1)
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine

    return Fsdp2Engine(spec, component, seed=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--first-version", type=int, default=1)
    ap.add_argument("--fault", default="")
    ap.add_argument("--case", default="qwen2-t2", help="the served model (tests.vllm.cases)")
    ap.add_argument("--modes", default="sharded", help="the update mode of each step, cycled")
    ap.add_argument(
        "--each", action="store_true", help="every step updates once in each mode, in order"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from areal_fn.runtime.vllm.trainer import VllmWeightSync
    from tests.vllm.cases import CASES

    spec = CASES[args.case].spec
    engine = build_engine(args.strategy, spec)
    sync = VllmWeightSync(
        engine, args.url, timeout_s=15.0, connect_timeout_s=120.0, bucket_bytes=256 << 10
    )
    records: list[dict[str, Any]] = []
    out = Path(args.out)
    ids = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))
    if args.fault:
        fault(args, sync, engine, rank, out)
        dist.destroy_process_group()
        return 0
    modes = args.modes.split(",")
    version = args.first_version
    for step in range(args.steps):
        stats = engine.train_step(ids)
        for mode in modes if args.each else [modes[step % len(modes)]]:
            records.append(update_and_generate(args, sync, engine, rank, version, mode, stats))
            version += 1
    canonical = engine.export_canonical()
    if rank == 0:
        from safetensors.torch import save_file

        export = out / "export"
        export.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in canonical.items()}, str(export / "model.safetensors")
        )
        (export / "config.json").write_text(json.dumps(CASES[args.case].config))
        (out / "records.json").write_text(json.dumps(records))
    dist.destroy_process_group()
    return 0


def update_and_generate(
    args: Any, sync: Any, engine: Any, rank: int, version: int, mode: str, stats: Any
) -> dict[str, Any]:
    """One update, vLLM generates, the trainer scores the tokens; rank 0's record."""
    report = sync.update(version, mode=mode)
    got: list[Any] = [None, None]
    if rank == 0:
        got = list(generate(args.url, args.model))
    dist.broadcast_object_list(got, src=0)
    tokens, vllm_lp = got
    want = engine.forward_logprobs(torch.tensor([PROMPT + tokens]))[0, len(PROMPT) - 1 :]
    if rank != 0:
        return {}
    return {
        "version": version,
        "mode": report.mode,
        "loss": stats["loss"],
        "tokens": tokens,
        "vllm_logprobs": vllm_lp,
        "trainer_logprobs": want.tolist(),
        "bytes_sent": report.bytes_sent,
        "lower_bound": report.lower_bound,
        "weight_version": report.weight_version,
        "seconds": report.seconds,
        "checksums": post(args.url, "/weight_checker", {"action": "checksum"})["checksums"],
    }


def fault(args: Any, sync: Any, engine: Any, rank: int, out: Path) -> None:
    """One refused update; rank 0 records what it saw."""
    from areal_fn.runtime.sync.executor import SyncError
    from areal_fn.runtime.vllm.deployment import VllmError

    seen: dict[str, Any] = {"fault": args.fault}
    if args.fault == "stale":
        try:
            sync.update(args.first_version)
            seen["error"] = None
        except (SyncError, VllmError) as e:
            seen["error"] = str(e)
    elif args.fault == "kill":
        import areal_fn.runtime.sync.executor as executor

        original = executor.send_and_receive

        def dying(*a: Any, **kw: Any) -> Any:
            def on_bucket(i: int) -> None:
                if rank == 1 and i >= 1:
                    os._exit(9)

            return original(*a, **{**kw, "on_bucket": on_bucket})

        import areal_fn.runtime.vllm.trainer as trainer

        trainer.send_and_receive = dying  # type: ignore[assignment]
        try:
            sync.update(args.first_version)
            seen["error"] = None
        except (SyncError, VllmError) as e:
            seen["error"] = str(e)
    if rank == 0:
        (out / f"fault-{args.fault}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    sys.exit(main())
