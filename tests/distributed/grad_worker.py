"""torchrun worker: one AdamW step of every engine against one step of the plain model.

Launched once by ``tests/distributed/test_grad_equivalence.py`` with 4 ranks (gloo, CPU).
For every case (model, strategy) every rank:

1. builds the reference: a transformers model of the tiny config with seeded random
   values in every parameter (norms around 1), its canonical tensors ``w0``, one step
   on the whole global batch (mean next-token cross entropy over all ``B * (S - 1)``
   targets, ``clip_grad_norm_``, ``torch.optim.AdamW``): loss, grad norm, the clipped
   canonical gradients, the updated canonical weights, the log-probs after the step;
2. builds the engine (``Fsdp2Engine`` / ``MegatronEngine``), ``load_canonical(w0)``,
   checks ``export_canonical()`` returns ``w0`` bitwise;
3. ``train_step`` on its data-parallel share of the same global batch (rows split
   evenly: every share has the same token count), then gathers the engine's local
   gradients into canonical tensors (``to_hf``), exports the weights, reads the
   optimizer state and the log-probs, and measures the differences.

Rank 0 writes ``<out>/results.json``: per case the figures and any error. Checks never
raise inside a case (a rank that raised would leave the others in a collective).
"""

import argparse
import datetime
import json
import re
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import LayoutError  # noqa: E402
from areal_fn.layouts.fsdp2 import Fsdp2Options  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.pipeline.partition import StagePlan  # noqa: E402
from areal_fn.plans.convert import to_hf  # noqa: E402
from areal_fn.runtime.engines.common import AdamWConfig, split_rows  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine, build_hf_model  # noqa: E402
from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions  # noqa: E402
from areal_fn.runtime.engines.megatron import MegatronEngine  # noqa: E402
from areal_fn.runtime.engines.packed import TokenSequence, pack_rows  # noqa: E402
from areal_fn.strategy.parse import parse_allocation  # noqa: E402
from tests.distributed import (  # noqa: E402
    dsa_configs,
    fp16_cases,
    gated_delta_configs,
    layer_type_configs,
)

WORLD = 4
BATCH, SEQ = 8, 16
ADAMW = AdamWConfig(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 0.5
#: Gradients at least this large (100 x eps) make AdamW's first step well conditioned.
CONDITIONED = 1e-6


def unexplained_weight_diff(
    w1: dict[str, torch.Tensor],
    ref_w1: dict[str, torch.Tensor],
    ref_grads: dict[str, torch.Tensor],
    grad_diff: float,
) -> float:
    """The largest weight difference after AdamW's first step beyond what the measured
    gradient difference ``grad_diff`` (the max over every element) explains. That step
    moves each weight by ``lr * g / (|g| + eps)`` (plus decay, equal on both sides), whose
    slope ``lr * eps / (|g| + eps)^2`` is steepest near ``g = 0``: a gradient off by at most
    ``grad_diff`` moves the weight by at most ``lr * eps / (max(|g| - grad_diff, 0) +
    eps)^2 * grad_diff``. What is left over is rounding of the weights and of the update."""
    lr, eps = ADAMW.lr, ADAMW.eps
    worst = float("-inf")
    for k, ref in ref_w1.items():
        g = ref_grads[k].double().abs()
        slope = lr * eps / ((g - grad_diff).clamp(min=0.0) + eps) ** 2
        excess = (w1[k].double() - ref.double()).abs() - slope * grad_diff
        worst = max(worst, float(excess.max()))
    return worst


#: Tiny configs: heads, KV heads and MLP widths divisible by 2; vocabularies not
#: multiples of 128 (Megatron pads them).
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 50,
        "torch_dtype": "float32",
    },
    "qwen2_4l": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 50,
        "torch_dtype": "float32",
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "vocab_size": 61,
        "torch_dtype": "float32",
    },
    "llama_tied": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 62,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
}

CONFIGS["mistral"] = {
    "model_type": "mistral",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 54,
    "sliding_window": None,
    "torch_dtype": "float32",
}
CONFIGS["mixtral"] = {
    "model_type": "mixtral",
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 52,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": None,
    "torch_dtype": "float32",
}

CONFIGS["glm4_moe"] = {
    "model_type": "glm4_moe",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 52,
    "moe_intermediate_size": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "use_qk_norm": True,
    "attention_bias": True,
    "torch_dtype": "float32",
}

CONFIGS["deepseek_v3"] = {
    "model_type": "deepseek_v3",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 52,
    "q_lora_rank": 8,
    "kv_lora_rank": 6,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "moe_intermediate_size": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "torch_dtype": "float32",
}

#: gpt-oss: attention sinks, a 5-token window on layer 0 (shorter than SEQ), biased router
#: and fused biased experts with the clamped SwiGLU, yarn rope (the config default).
CONFIGS["gpt_oss"] = {
    "model_type": "gpt_oss",
    "hidden_size": 16,
    "intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 52,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 5,
    "swiglu_limit": 0.5,  # low enough that the clamps bite on random weights
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}

#: the families with per-layer attention kinds (layer_type_configs): a 5-token window,
#: shorter than SEQ
CONFIGS["olmo3"] = layer_type_configs.olmo3(5)
CONFIGS["olmo2"] = layer_type_configs.olmo2()
CONFIGS["gemma3_text"] = layer_type_configs.gemma3_text(5)
CONFIGS["minimax_m2"] = layer_type_configs.minimax_m2()
#: the gated-delta-net families: linear-attention layers with gated full attention
CONFIGS["qwen3_next"] = gated_delta_configs.qwen3_next()
CONFIGS["qwen3_5_text"] = gated_delta_configs.qwen3_5_text()
CONFIGS["qwen3_5_moe_text"] = gated_delta_configs.qwen3_5_moe_text()
#: DeepSeek sparse attention (dsa_configs): the indexer's top-k shorter than the sequence
CONFIGS["deepseek_v32"] = dsa_configs.deepseek_v32()
CONFIGS["glm_moe_dsa"] = dsa_configs.glm_moe_dsa()

#: label -> (allocation string, HSDP replicas, pipeline chunk lengths or None for the
#: even split, FSDP2 run options). All fill the 4 ranks.
STRATEGIES: dict[str, tuple[str, int, tuple[int, ...] | None, Fsdp2RunOptions]] = {
    "fsdp:d4": ("fsdp:d4", 1, None, Fsdp2RunOptions()),
    "fsdp:d2t2": ("fsdp:d2t2", 1, None, Fsdp2RunOptions()),
    "fsdp:d2t2[ac,offload]": (
        "fsdp:d2t2",
        1,
        None,
        Fsdp2RunOptions(activation_checkpointing=True, cpu_offload=True),
    ),
    "hsdp:d4r2": ("fsdp:d4", 2, None, Fsdp2RunOptions()),
    "fsdp:d2c2": ("fsdp:d2c2", 1, None, Fsdp2RunOptions()),
    "fsdp:t2c2": ("fsdp:t2c2", 1, None, Fsdp2RunOptions()),
    "hsdp:d2r2c2": ("fsdp:d2c2", 2, None, Fsdp2RunOptions()),
    "megatron:d2t2": ("megatron:d2t2", 1, None, Fsdp2RunOptions()),
    "megatron:d2p2": ("megatron:d2p2", 1, None, Fsdp2RunOptions()),
    "megatron:t2p2": ("megatron:t2p2", 1, None, Fsdp2RunOptions()),
    "megatron:d2p2v2": ("megatron:d2p2v2", 1, None, Fsdp2RunOptions()),
    "megatron:d2p2[1,3]": ("megatron:d2p2", 1, (1, 3), Fsdp2RunOptions()),
    # context parallelism (Megatron's load-balanced 2*cp chunks), with DP, TP, PP, EP
    "megatron:d2c2": ("megatron:d2c2", 1, None, Fsdp2RunOptions()),
    "megatron:t2c2": ("megatron:t2c2", 1, None, Fsdp2RunOptions()),
    "megatron:p2c2": ("megatron:p2c2", 1, None, Fsdp2RunOptions()),
    "megatron:d2c2e2": ("megatron:d2c2e2", 1, None, Fsdp2RunOptions()),
}

#: A label ending in this runs with ``global_mask()``: unequal token counts per share.
MASKED = "+mask"
#: A label ending in this trains on packed variable-length sequences (``PACKED_LENGTHS``,
#: a prompt of 2 tokens that are not targets, per-token weights), against the plain
#: model run on each sequence alone.
PACKED = "+pack"
PACKED_LENGTHS = (16, 5, 9, 12, 3, 16, 7, 10)
PACKED_BUDGET = 16
#: Per model, a budget that packs two sequences into every row of a 4-share split (the
#: gated-delta-net families: their linear-attention layers run each sequence alone).
PACKED_BUDGET_OF = {"qwen3_next": 32, "qwen3_5_moe_text": 32}
#: A label ending in this runs fp16 with a dynamic loss scale for several steps
#: (``fp16_cases.py``).
FP16 = fp16_cases.FP16

CASES: tuple[tuple[str, str], ...] = (
    ("qwen2", "fsdp:d4"),
    ("qwen2", "fsdp:d2t2"),
    ("qwen2", "fsdp:d2t2[ac,offload]"),
    ("qwen2", "hsdp:d4r2"),
    ("qwen2", "fsdp:d2c2"),
    ("qwen2", "hsdp:d2r2c2+pack"),
    ("qwen2", "fsdp:d4+mask"),
    ("qwen2", "megatron:d2p2+mask"),
    ("qwen2", "megatron:d2t2"),
    ("qwen2", "megatron:d2p2"),
    ("qwen2", "megatron:t2p2"),
    ("qwen2_4l", "megatron:d2p2v2"),
    ("qwen2_4l", "megatron:d2p2[1,3]"),
    ("qwen2", "megatron:d2c2"),
    ("qwen2", "megatron:t2c2"),
    ("qwen2", "megatron:p2c2+pack"),
    ("deepseek_v3", "megatron:d2c2e2"),  # multi-latent attention and experts under CP
    ("qwen3", "fsdp:d2t2"),
    ("qwen3", "fsdp:t2c2"),
    ("qwen3", "megatron:d2t2"),
    ("llama_tied", "fsdp:d2t2"),
    ("llama_tied", "megatron:d2p2"),
    ("llama_tied", "megatron:t2p2"),
    ("mistral", "fsdp:d2t2"),
    ("mistral", "megatron:d2t2"),
    ("mixtral", "fsdp:d4"),
    ("mixtral", "fsdp:t2c2"),  # 1 KV head per TP rank, repeated for cp=2
    ("mixtral", "megatron:d2p2"),
    ("glm4_moe", "fsdp:d2t2"),
    ("glm4_moe", "megatron:d2p2"),
    ("deepseek_v3", "fsdp:d2t2"),
    ("deepseek_v3", "megatron:d2p2"),
    ("gpt_oss", "fsdp:d4"),
    ("gpt_oss", "fsdp:d2t2"),  # sinks sharded by head beside column-wise q/k/v
    ("gpt_oss", "fsdp:t2c2"),  # Ulysses: each rank adds the sinks of the heads it runs
    ("gpt_oss", "megatron:d2p2"),
    ("olmo3", "fsdp:d4"),
    ("olmo3", "fsdp:d2c2"),  # Ulysses: sliding windows over the gathered sequence
    ("olmo2", "fsdp:d2c2"),  # Ulysses: q/k norms over the whole projection per token
    ("gemma3_text", "fsdp:d2t2"),
    ("gemma3_text", "fsdp:t2c2"),
    ("minimax_m2", "fsdp:d4"),
    ("minimax_m2", "fsdp:d2c2"),  # Ulysses: q/k norms over the whole projection per token
    ("qwen3_next", "fsdp:d4"),  # gated delta net: no Ulysses
    ("qwen3_next", "megatron:d2p2"),  # Megatron-Core's GatedDeltaNet (MoE: no TP training)
    ("qwen3_5_text", "fsdp:d4"),
    ("qwen3_5_text", "megatron:d2t2"),  # in_proj and conv1d split by key-head group
    ("qwen3_5_moe_text", "hsdp:d4r2"),
    ("qwen3_next", "fsdp:d4+pack"),  # packed rows: each sequence's linear attention alone
    ("qwen3_5_moe_text", "hsdp:d4r2+pack"),
    ("qwen3_next", "fsdp:d2t2"),  # linear attention by key-head group (fused projections)
    ("qwen3_5_moe_text", "fsdp:d2t2"),  # [q; k; v] on each rank's rows
    ("qwen3_next", "fsdp:d2t2+pack"),  # packed rows under tp
    ("deepseek_v32", "fsdp:d4"),  # the indexer runs without gradient (transformers)
    ("deepseek_v32", "fsdp:d2t2"),  # indexer replicated beside column-wise MLA
    ("glm_moe_dsa", "fsdp:d2t2"),
)


def randomized_model(spec: ModelSpec, seed: int) -> nn.Module:
    """The transformers model of ``spec`` with seeded random values in every parameter."""
    model = build_hf_model(spec, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def global_batch(vocab: int) -> Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def canonical_of(model: nn.Module, spec: ModelSpec, *, grads: bool = False) -> dict[str, Tensor]:
    sd = model.state_dict(keep_vars=True)
    src = {
        k: torch.zeros_like(v)
        if grads and v.grad is None
        else (v.grad if grads else v).detach().clone()
        for k, v in sd.items()
    }  # a buffer (GLM's router bias) has no gradient: zero
    return hf_state_to_canonical(src, spec)


def global_mask() -> Tensor:
    """A loss mask whose rows keep 3..15 of their 15 targets: data-parallel shares differ."""
    keep = torch.tensor([15, 3, 9, 12, 5, 15, 7, 10])[:BATCH]
    mask = torch.arange(SEQ).unsqueeze(0) >= SEQ - keep.unsqueeze(1)
    mask[:, 0] = False  # column 0 is never a target
    return mask


def reference(config: str, *, masked: bool = False) -> dict[str, Any]:
    """One single-process AdamW step of the plain model on the whole global batch.

    The loss is the mean over every target token of the batch (the masked ones when
    ``masked``).
    """
    spec = model_from_hf_config(CONFIGS[config])
    model = randomized_model(spec, seed=11)
    w0 = canonical_of(model, spec)
    ids = global_batch(spec.vocab_size)
    mask = global_mask() if masked else torch.ones(ids.shape, dtype=torch.bool)
    logits = model(input_ids=ids).logits[:, :-1]
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    weights = mask[:, 1:].reshape(-1).float()
    loss = (token_loss * weights).sum() / weights.sum()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    grads = canonical_of(model, spec, grads=True)
    opt = ADAMW.build(model.parameters())
    opt.step()
    w1 = canonical_of(model, spec)
    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], dim=-1)
        logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return {
        "spec": spec,
        "ids": ids,
        "mask": mask if masked else None,
        "tokens": float(weights.sum()),
        "w0": w0,
        "loss": float(loss),
        "norm": norm,
        "grads": grads,
        "w1": w1,
        "logp": logp,
    }


def packed_data(vocab: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(ids, loss_mask, weights)`` of every packed sequence (2 prompt tokens each)."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for n in PACKED_LENGTHS:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        out.append((ids, torch.arange(n) >= 2, 0.5 + torch.rand(n, generator=gen)))
    return out


def reference_packed(config: str) -> dict[str, Any]:
    """One single-process AdamW step of the plain model, each sequence run on its own.

    The loss is ``sum(weights * CE)`` over the targets of all sequences divided by
    their count; log-probs after the step per sequence.
    """
    spec = model_from_hf_config(CONFIGS[config])
    model = randomized_model(spec, seed=11)
    w0 = canonical_of(model, spec)
    data = packed_data(spec.vocab_size)
    total = torch.zeros(())
    count = 0.0
    for ids, mask, w in data:
        logits = model(input_ids=ids[None]).logits[0, :-1]
        token_loss = F.cross_entropy(logits, ids[1:], reduction="none")
        total = total + (token_loss * mask[1:].float() * w[1:]).sum()
        count += float(mask[1:].sum())
    loss = total / count
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    grads = canonical_of(model, spec, grads=True)
    opt = ADAMW.build(model.parameters())
    opt.step()
    w1 = canonical_of(model, spec)
    model.eval()
    logp = []
    with torch.no_grad():
        for ids, _, _ in data:
            lp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], dim=-1)
            logp.append(lp.gather(-1, ids[1:, None]).squeeze(-1))
    return {
        "spec": spec,
        "data": data,
        "tokens": count,
        "w0": w0,
        "loss": float(loss),
        "norm": norm,
        "grads": grads,
        "w1": w1,
        "logp": logp,
    }


def token_hooks(engine: Any) -> list[int]:
    """Record how many tokens this rank's embedding and first attention layer see."""
    seen: list[int] = []
    if isinstance(engine, MegatronEngine):
        return megatron_token_hooks(engine)
    if not isinstance(engine, Fsdp2Engine):
        return seen

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        seen.append(int(x.shape[1]))

    first = engine.model.get_submodule("model.layers.0")
    mixer = "self_attn" if hasattr(first, "self_attn") else "linear_attn"  # gated delta net
    for name in ("model.embed_tokens", f"model.layers.0.{mixer}"):
        engine.model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def megatron_token_hooks(engine: MegatronEngine) -> list[int]:
    """Record how many tokens this rank's embedding (first stage) and each chunk's first
    attention layer see (Megatron's hidden states are ``[s, b, h]``)."""
    seen: list[int] = []

    def embedding(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(int((args[0] if args else kwargs["input_ids"]).shape[1]))

    def attention(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(int((args[0] if args else kwargs["hidden_states"]).shape[0]))

    for chunk in engine.chunks:
        gpt = chunk.module
        if gpt.pre_process:
            gpt.embedding.register_forward_pre_hook(embedding, with_kwargs=True)
        gpt.decoder.layers[0].self_attention.register_forward_pre_hook(attention, with_kwargs=True)
    return seen


def packed_share(engine: Any, ref: dict[str, Any]) -> tuple[list[TokenSequence], int]:
    """This share's packed sequences (dealt round-robin) and the row budget."""
    seqs = [
        TokenSequence(input_ids=ids, loss_mask=mask, weights=w)
        for i, (ids, mask, w) in enumerate(ref["data"])
        if i % engine.dp_size == engine.dp_rank
    ]
    return seqs, PACKED_BUDGET_OF.get(ref["spec"].model_type, PACKED_BUDGET)


def train_and_logprobs(engine: Any, label: str, ref: dict[str, Any]) -> tuple[Any, float]:
    """The engine's step on its share and the largest log-prob difference after it."""
    if label.endswith(PACKED):
        seqs, budget = packed_share(engine, ref)
        stats = engine.train_step_packed(seqs, max_tokens_per_micro_batch=budget)
        logp = engine.forward_logprobs_packed(seqs, max_tokens_per_micro_batch=budget)
        want = [lp for i, lp in enumerate(ref["logp"]) if i % engine.dp_size == engine.dp_rank]
        diff = max(float((a - b).abs().max()) for a, b in zip(logp, want, strict=True))
        return stats, diff
    ids = split_rows(ref["ids"], engine.dp_size, engine.dp_rank)
    mask = ref["mask"]
    stats = engine.train_step(
        ids, None if mask is None else split_rows(mask, engine.dp_size, engine.dp_rank)
    )
    logp = engine.forward_logprobs(ids)
    want_logp = split_rows(ref["logp"], engine.dp_size, engine.dp_rank)
    return stats, float((logp - want_logp).abs().max())


def max_abs(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def bitwise(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in b
    )


def build_engine(spec: ModelSpec, label: str) -> Any:
    text, replicas, lengths, run_options = STRATEGIES[
        label.removesuffix(MASKED).removesuffix(PACKED)
    ]
    component = parse_allocation(text).training
    if label.startswith(("fsdp", "hsdp")):
        return Fsdp2Engine(
            spec,
            component,
            options=Fsdp2Options(hsdp_replicas=replicas),
            run_options=run_options,
            optimizer=ADAMW,
            grad_clip=CLIP,
        )
    stages = (
        None
        if lengths is None
        else StagePlan(costs=(1.0,) * spec.num_layers, num_stages=2, stage_lengths=lengths)
    )
    return MegatronEngine(
        spec, component, stages=stages, optimizer=ADAMW, grad_clip=CLIP, micro_batch_size=1
    )


def run_case(config: str, label: str, ref: dict[str, Any]) -> dict[str, Any]:
    spec = ref["spec"]
    engine = build_engine(spec, label)
    try:
        out: dict[str, Any] = {"world": engine.layout.world_size}
        engine.load_canonical(ref["w0"])
        out["load_export_bitwise"] = bitwise(engine.export_canonical(), ref["w0"])
        created = engine.optimizer_local_state(create=True)  # zero state the step then uses
        out["optimizer_created_zero"] = all(
            float(st["step"]) == 0.0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
            for st in created.values()
        )
        seen = token_hooks(engine)
        stats, logp_max = train_and_logprobs(engine, label, ref)
        gathered_seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered_seen, seen)
        out["tokens_seen"] = gathered_seen  # per rank: embedding, layer-0 attention, ...
        out["dp_size"], out["sp"] = engine.dp_size, getattr(engine, "sp", 1)
        if label.endswith(PACKED) and isinstance(engine, Fsdp2Engine):  # sequences per row
            seqs, budget = packed_share(engine, ref)
            rows = [
                len(r.sequences) for r in pack_rows(seqs, max_tokens=budget, multiple_of=engine.sp)
            ]
            gathered_rows: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered_rows, rows)
            out["sequences_per_row"] = gathered_rows
        if isinstance(engine, Fsdp2Engine) and engine.sp > 1:  # refused before any collective
            try:
                engine.train_step(ref.get("ids", torch.zeros(1, SEQ, dtype=torch.long))[:1, :-1])
                out["odd_length_error"] = None
            except LayoutError as e:
                out["odd_length_error"] = str(e)
        state = engine.local_state()
        local = {  # a buffer has no gradient: zero (as the reference's canonical_of)
            k: torch.zeros_like(state[k]).cpu() if g is None else g.detach().cpu().clone()
            for k, g in engine.local_grads().items()
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        grads = to_hf(dict(enumerate(gathered)), engine.layout)
        w1 = engine.export_canonical()
        worst_name, _ = max(
            ((k, float((w1[k] - ref["w1"][k]).abs().max())) for k in ref["w1"]),
            key=lambda kv: kv[1],
        )
        worst_at = int((w1[worst_name] - ref["w1"][worst_name]).abs().argmax())
        opt = engine.optimizer_local_state()
        # the layout's tensors less the buffers (a router's bias): what the optimizer steps
        names = {
            n
            for n in engine.local_state()
            if not n.endswith(("e_score_correction_bias", "mlp.router.expert_bias"))
        }
        logp_diff = torch.tensor(logp_max, dtype=torch.float64)
        dist.all_reduce(logp_diff, op=dist.ReduceOp.MAX)
        grad_scale = max(float(g.abs().max()) for g in ref["grads"].values())
        still = {n for n, st in opt.items() if float(st["step"]) == 0.0}
        out.update(
            loss=stats["loss"],
            ref_loss=ref["loss"],
            loss_abs_diff=abs(stats["loss"] - ref["loss"]),
            grad_norm=stats["grad_norm"],
            ref_grad_norm=ref["norm"],
            grad_norm_rel_diff=abs(stats["grad_norm"] - ref["norm"]) / ref["norm"],
            clip_coef=stats["clip_coef"],
            lr=stats["lr"],
            tokens=stats["tokens"],
            ref_tokens=ref["tokens"],
            grad_max_abs_diff=max_abs(grads, ref["grads"]),
            grad_scale=grad_scale,
            grad_rel_diff=max_abs(grads, ref["grads"]) / grad_scale,
            grad_worst=max(
                ref["grads"], key=lambda k: float((grads[k] - ref["grads"][k]).abs().max())
            ),
            weight_max_abs_diff=max_abs(w1, ref["w1"]),
            weight_unexplained=unexplained_weight_diff(
                w1, ref["w1"], ref["grads"], max_abs(grads, ref["grads"])
            ),
            weight_max_abs_diff_conditioned=max(
                float((w1[k] - ref["w1"][k])[ref["grads"][k].abs() >= CONDITIONED].abs().max())
                for k in ref["w1"]
                if bool((ref["grads"][k].abs() >= CONDITIONED).any())
            ),
            weight_step=max_abs(ref["w1"], ref["w0"]),
            weight_worst=worst_name,
            weight_worst_ref_grad=abs(float(ref["grads"][worst_name].reshape(-1)[worst_at])),
            logprob_max_abs_diff=float(logp_diff),
            # parameters no gradient reaches (the DSA indexer: its top-k is not
            # differentiable) keep their zero state; the rest took one step
            optimizer_steps=sorted({float(st["step"]) for n, st in opt.items() if n not in still}),
            optimizer_untrained=sorted(still),
            untrained_have_no_ref_grad=all(
                n in ref["grads"] and not bool(ref["grads"][n].any()) for n in still
            ),
            optimizer_names_ok=set(opt) == names,
            optimizer_shapes_ok=all(
                tuple(opt[n][k].shape) == tuple(t.shape)
                for n, t in engine.local_state().items()
                if n in names
                for k in ("exp_avg", "exp_avg_sq")
            ),
        )
        return out
    finally:
        if isinstance(engine, MegatronEngine):
            engine.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="", help="comma-separated config/label (default all)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    # commas inside brackets belong to a label ("fsdp:d2t2[ac,offload]")
    wanted = {tuple(c.split("/", 1)) for c in re.split(r",(?![^\[]*\])", args.cases) if c}
    every = CASES + fp16_cases.FP16_CASES  # fp16: several steps against torch's AMP
    cases = [c for c in every if not wanted or c in wanted]
    results: dict[str, Any] = {}
    refs: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    try:
        for config, label in cases:
            t0 = time.monotonic()
            try:
                suffix = next((x for x in (MASKED, PACKED, FP16) if label.endswith(x)), "")
                key = f"{config}{suffix}"
                if key not in refs and suffix == FP16:
                    refs[key] = fp16_cases.reference(
                        config, CONFIGS, randomized_model, canonical_of
                    )
                elif key not in refs and suffix == PACKED:
                    refs[key] = reference_packed(config)
                elif key not in refs:
                    refs[key] = reference(config, masked=suffix == MASKED)
                run = fp16_cases.run_fp16_case if suffix == FP16 else partial(run_case, config)
                rec = run(label, refs[key])
                rec["error"] = None
            except Exception:
                rec = {"error": traceback.format_exc()}
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, rec["error"])
            rec["rank_errors"] = errors
            rec["seconds"] = round(time.monotonic() - t0, 2)
            results[f"{config}/{label}"] = rec
            if rank == 0:
                print(f"{config}/{label}: {json.dumps(rec)}", flush=True)
    finally:
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(
                json.dumps(
                    {
                        "world_size": dist.get_world_size(),
                        "torch": torch.__version__,
                        "cases": results,
                        "seconds": round(time.monotonic() - start, 2),
                    },
                    indent=1,
                    sort_keys=True,
                )
            )
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
