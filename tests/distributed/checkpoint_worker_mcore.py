"""torchrun worker (2 ranks, gloo, CPU): Megatron-Core's own checkpoints in and out.

1. Megatron-Core builds a ``GPTModel`` under tp=2 (CPU, local spec), holding known
   canonical weights (placed with ``to_megatron``), and saves it with its own
   ``dist_checkpointing.save`` (``torch_dist`` backend).
2. Rank 0 imports that checkpoint into canonical space
   (:func:`import_megatron_checkpoint`): bitwise equal to the weights put in. It then
   exports the canonical weights (:func:`export_megatron_checkpoint`).
3. Megatron-Core builds the model under pp=2 and loads the export with its own
   ``dist_checkpointing.load``: every parameter bitwise equal to what ``to_megatron``
   makes of the weights for that rank.

Megatron's ``torch_dist`` writer logs the process memory through ``psutil`` (in the dev
extra); where psutil is missing the worker stubs that logging probe (it only feeds a
debug message). Results: ``<out>/rank<r>.json`` ``{"checks": {name: problem or ""}}``.
"""

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.layouts.megatron import megatron_layout  # noqa: E402
from areal_fn.layouts.vocab import padded_vocab_size  # noqa: E402
from areal_fn.model.spec import ModelSpec  # noqa: E402
from areal_fn.plans.convert import to_megatron  # noqa: E402
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    export_megatron_checkpoint,
    import_megatron_checkpoint,
)
from areal_fn.runtime.megatron.build import (  # noqa: E402
    MegatronSizes,
    build_gpt_model,
    megatron_session,
    transformer_config,
)
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402
from tests.distributed.checkpoint_worker_util import bits, model  # noqa: E402

SPEC = model(torch_dtype="float32", tie_word_embeddings=False)
VOCAB_PADDED = padded_vocab_size(SPEC.vocab_size, tp=2)  # 256: both strategies below


def arch(spec: ModelSpec) -> dict[str, Any]:
    return {
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "qkv_bias": spec.qkv_bias,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
    }


def canonical() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {t.name: torch.randn(t.shape, generator=g) for t in SPEC.tensors}


def stub_psutil_probe() -> None:
    """Only where psutil is missing (the dev extra installs it): Megatron's writer then
    cannot log its memory; stub that one log call."""
    import importlib.util

    if importlib.util.find_spec("psutil") is not None:
        return
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa

    fa._process_memory = lambda: 0


def build(sizes: MegatronSizes) -> Any:
    config = transformer_config(arch(SPEC), sizes)
    return build_gpt_model(arch(SPEC), config, vocab_size=VOCAB_PADDED)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    checks: dict[str, str] = {}
    truth = canonical()
    from megatron.core import dist_checkpointing

    stub_psutil_probe()
    rank = -1
    try:
        # 1. Megatron saves under tp=2
        with megatron_session(MegatronSizes(tp=2), seed=0):
            rank = dist.get_rank()
            gpt = build(MegatronSizes(tp=2))
            local = to_megatron(truth, megatron_layout(SPEC, ParallelDims(tp=2)), rank)
            with torch.no_grad():
                for name, param in gpt.named_parameters():
                    param.copy_(local[name])
            (out / "mcore_t2").mkdir(exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(gpt.sharded_state_dict(), str(out / "mcore_t2"))
            dist.barrier()
        # 2. import, export (rank 0)
        if rank == 0:
            try:
                got = import_megatron_checkpoint(out / "mcore_t2", SPEC, trust_pickle=True)
                bad = [n for n in truth if not torch.equal(bits(got[n]), bits(truth[n]))]
                checks["import"] = f"differ: {bad[:4]}" if bad or got.keys() != truth.keys() else ""
                export_megatron_checkpoint(
                    got, SPEC, out / "ours_export", vocab_size_padded=VOCAB_PADDED
                )
            except Exception:
                checks["import"] = traceback.format_exc()[-2000:]
        dist.barrier()
        # 3. Megatron loads the export under pp=2
        with megatron_session(MegatronSizes(pp=2), seed=1):
            gpt = build(MegatronSizes(pp=2))
            try:
                state = dist_checkpointing.load(gpt.sharded_state_dict(), str(out / "ours_export"))
                gpt.load_state_dict(state)
                want = to_megatron(truth, megatron_layout(SPEC, ParallelDims(pp=2)), rank)
                params = dict(gpt.named_parameters())
                bad = [
                    n
                    for n, w in want.items()
                    if n not in params or not torch.equal(bits(params[n].detach()), bits(w))
                ]
                checks["megatron loads the export under pp=2"] = f"differ: {bad[:4]}" if bad else ""
            except Exception:
                checks["megatron loads the export under pp=2"] = traceback.format_exc()[-2000:]
            dist.barrier()
    finally:
        (out / f"rank{max(rank, 0)}.json").write_text(json.dumps({"checks": checks}, indent=1))


if __name__ == "__main__":
    main()
