"""One oracle case: a real vLLM engine loads an HF checkpoint; every rank's parameters
(model format, as vLLM's own loaders filled them) against ``vllm_layout``'s pieces.

Run by ``test_vllm_layout.py`` in a process of its own (vLLM spawns its engine
processes): ``python -m tests.vllm.layout_worker --case NAME --out FILE``.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def expected(case_name: str, hf_dir: Path, tp: int) -> dict[int, dict[str, object]]:
    import torch
    from safetensors.torch import load_file

    from areal_fn.layouts.vllm import vllm_layout
    from areal_fn.strategy.allocation import ParallelDims
    from tests.vllm.cases import CASES

    spec = CASES[case_name].spec
    hf: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    layout = vllm_layout(spec, ParallelDims(tp=tp))
    out: dict[int, dict[str, object]] = {}
    for r in range(layout.world_size):
        tensors = {}
        for lt in layout.local_tensors(r):
            t = torch.zeros(lt.shape, dtype=torch.float32)
            for p in lt.pieces:
                if p.canonical is None:
                    continue
                assert p.canonical_box is not None
                t[p.local_box.slices()] = hf[p.canonical][p.canonical_box.slices()]
            tensors[lt.name] = t
        out[r] = tensors
    return out


def sync_and_generate(llm: object, case: object) -> dict[str, object]:
    """A one-rank trainer (``fsdp:d1``, this process) updates the offline engine
    (``LlmDeployment``) in each mode, which then generates; both score the tokens."""
    import socket

    import torch
    import torch.distributed as dist

    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.runtime.vllm.trainer import VllmWeightSync
    from areal_fn.strategy.allocation import ParallelDims

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    spec = case.spec  # type: ignore[attr-defined]
    engine = Fsdp2Engine(spec, ParallelDims(dp=1), seed=5)
    engine.train_step(
        torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    )
    sync = VllmWeightSync(engine, llm)
    out: dict[str, object] = {}
    for version, mode in enumerate(("sharded", "full"), start=1):
        report = sync.update(version, mode=mode)
        out[mode] = {
            "bytes_sent": report.bytes_sent,
            "lower_bound": report.lower_bound,
            "weight_version": report.weight_version,
            "max_diff": _score(llm, engine),
        }
    dist.destroy_process_group()
    return out


def _score(llm: object, engine: object) -> float:
    """vLLM generates greedily; the largest gap between its log-probs and the trainer's."""
    import torch
    from vllm import SamplingParams

    prompt = [5, 17, 42, 7]
    done = llm.generate(  # type: ignore[attr-defined]
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=6, logprobs=0, temperature=0, detokenize=False),
        use_tqdm=False,
    )[0].outputs[0]
    tokens = list(done.token_ids)
    got = [lp[t].logprob for lp, t in zip(done.logprobs, tokens, strict=True)]
    want = engine.forward_logprobs(torch.tensor([prompt + tokens]))  # type: ignore[attr-defined]
    return max(abs(a - float(b)) for a, b in zip(got, want[0, len(prompt) - 1 :], strict=True))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tests.vllm.cases import CASES, write_model

    case = CASES[args.case]
    work = Path(tempfile.mkdtemp(prefix="vllm_layout_"))
    hf_dir = write_model(work / "hf", case.config, seed=3)
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    extra = (
        {"weight_transfer_config": WeightTransferConfig(backend="areal_fn")} if case.sync else {}
    )
    llm = LLM(
        model=str(hf_dir),
        tensor_parallel_size=case.tp,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        worker_extension_cls="tests.vllm.vllm_ext.SnapshotExtension",
        **extra,
    )
    import torch

    paths = llm.collective_rpc("snapshot", args=(str(hf_dir), str(work)))
    got = [torch.load(p) for p in paths]
    want = expected(args.case, hf_dir, case.tp)

    report: dict[str, object] = {"case": args.case, "ranks": []}
    for g, w in zip(got, [want[i] for i in range(case.tp)], strict=True):
        rank = {
            "vllm_names": sorted(g),
            "our_names": sorted(w),
            "shape_mismatch": sorted(
                f"{n}: vllm {tuple(g[n].shape)} ours {tuple(w[n].shape)}"
                for n in set(g) & set(w)
                if tuple(g[n].shape) != tuple(w[n].shape)
            ),
            "value_mismatch": sorted(
                n
                for n in set(g) & set(w)
                if tuple(g[n].shape) == tuple(w[n].shape) and not torch.equal(g[n], w[n])
            ),
            "compared": len(set(g) & set(w)),
            "elements": sum(int(w[n].numel()) for n in set(g) & set(w)),
        }
        report["ranks"].append(rank)  # type: ignore[attr-defined]
    if case.sync:
        report["sync"] = sync_and_generate(llm, case)
    Path(args.out).write_text(json.dumps(report, indent=1))
    del llm
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("AREAL_FN_SYNC_SECRET", os.urandom(32).hex())
    sys.exit(main())
