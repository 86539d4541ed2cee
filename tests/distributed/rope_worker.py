"""Worker of ``test_megatron_rope.py``: MegatronEngine log-probs with llama3 rope scaling.

Run under ``torchrun --nproc-per-node 1``. A tiny Llama with Llama 3.1's rope scaling
(``rope_type`` llama3, factor 8, Megatron's fixed low/high frequency factors and
original context 8192) and ``head_dim`` 16, so that some rotary frequencies are scaled,
some smoothed and some left alone: the transformers model (the FSDP2 engine's builder)
and :class:`~areal_fn.runtime.engines.megatron.MegatronEngine` loaded with the same
canonical weights give their log-probs; so does the transformers model without rope
scaling (to show the check can tell). (Megatron without the scaling would match that one instead.) A yarn config must be refused before any
Megatron state is built. Writes one JSON record to ``--out``.
"""

import argparse
import json
import sys
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import LayoutError  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.spec import model_from_hf_config  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import build_hf_model  # noqa: E402
from areal_fn.runtime.engines.megatron import MegatronEngine  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

LLAMA3 = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "torch_dtype": "float32",
}


def _hf_logprobs(spec, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Log-probs of the transformers model with weights of std 0.3 (peaked, position-sensitive)."""
    model = build_hf_model(spec, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp, hf_state_to_canonical(model.state_dict(), spec)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    spec = model_from_hf_config(LLAMA3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (2, 96), generator=g)
    want, canonical = _hf_logprobs(spec, ids)
    plain, _ = _hf_logprobs(attrs.evolve(spec, rope_scaling=()), ids)
    with MegatronEngine(spec, ParallelDims()) as engine:
        engine.load_canonical(canonical)
        got = engine.forward_logprobs(ids)
    yarn = attrs.evolve(
        spec,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    )
    try:
        MegatronEngine(yarn, ParallelDims())
        refused = ""
    except LayoutError as e:
        refused = str(e)
    record = {
        "megatron_vs_hf": float((got - want).abs().max()),
        "hf_scaled_vs_plain": float((want - plain).abs().max()),
        "megatron_vs_plain": float((got - plain).abs().max()),
        "yarn_refused": refused,
    }
    Path(args.out).write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
