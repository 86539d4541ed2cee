"""torchrun worker: HF <-> Megatron-Core conversion through areal_fn, checked by logits.

Launched once by ``tests/distributed/test_conversion_parity.py`` with 4 ranks (gloo). For
every case (model family x parallel strategy):

1. rank 0 builds a ``transformers`` model (fp32, eager attention, non-trivial random
   weights) and its reference logits; its canonical tensors
   (:func:`hf_state_to_canonical`) go to every rank;
2. every rank builds a real Megatron-Core ``GPTModel`` (local spec, vocabulary padded
   as :func:`megatron_layout` pads it) and loads ``to_megatron(canonical, layout,
   rank)`` with ``load_state_dict(strict=False)``: every parameter must be loaded and
   the only missing keys are ``_extra_state``; padding rows must come in as zeros;
3. Megatron's logits (vocabulary padding sliced off) are compared with the HF logits;
4. ``to_hf`` of every rank's parameters, gathered on rank 0, must give back the
   canonical tensors bitwise;
5. the reverse: every local parameter gets seeded noise, made consistent across
   replicas with Megatron's own process groups (averaged over the data-parallel
   group, over the tensor-parallel group for parameters that are not TP-partitioned,
   over the expert groups for experts, over the embedding group for tied embeddings
   split across stages: what a gradient all-reduce does); the new parameters are
   exported with ``to_hf`` (every rank's copy of every piece is checked against the
   export, so replicas must agree bitwise), written with
   :func:`write_hf_checkpoint`, loaded with ``from_pretrained`` and the HF logits are
   compared with the perturbed Megatron model's.

Rank 0 writes ``<out>/report.json`` (max abs diffs per case, timings, versions).
"""

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import canonical_region, to_hf, to_megatron
from areal_fn.runtime.megatron.build import (
    MegatronSizes,
    build_model_chunks,
    forward_logits,
    gather_tp_logits,
    init_distributed,
    megatron_session,
    pipeline_forward_logits,
    transformer_config,
)
from areal_fn.strategy.allocation import ParallelDims

# ----------------------------------------------------------------- families

#: vocab 120 is padded by Megatron's rule (multiple of 128 * tp): 8 padding rows under
#: tp=1, 136 under tp=2, so padding is always present and exercised.
_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 120,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

#: gated delta net: two key heads of 16, four value heads of 8, a conv of 4 taps
_LINEAR: dict[str, Any] = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
#: routed experts and the gated shared expert
_GATED_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {**_BASE, "model_type": "qwen2"},  # qkv bias
    # head_dim 32 != hidden_size / heads = 16; q_norm / k_norm
    "qwen3": {**_BASE, "model_type": "qwen3", "head_dim": 32},
    "llama_tied": {
        **_BASE,
        "model_type": "llama",
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
        "rope_theta": 500_000.0,
    },
    "llama_untied": {**_BASE, "model_type": "llama", "rope_theta": 500_000.0},
    "mistral": {**_BASE, "model_type": "mistral", "head_dim": None, "sliding_window": None},
    # every layer sparse, experts intermediate_size wide
    "mixtral": {
        **_BASE,
        "model_type": "mixtral",
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    # dense layer 0; sigmoid routing, expert bias, 2 groups, shared expert, partial rotary
    "glm4_moe": {
        **_BASE,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    # multi-latent attention with a query LoRA, yarn rope; dense layer 0, sigmoid routing
    # with expert bias, 2 groups, a shared expert
    "deepseek_v3": {
        **_BASE,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "head_dim": None,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    # no query LoRA (q_proj), plain rope, two shared experts, no expert groups
    "deepseek_v3_noq": {
        **_BASE,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "head_dim": None,
        "q_lora_rank": None,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 2,
    },
    # rope_interleave false: transformers rotates the rope halves as they are; the layout
    # lays the q and kv_a rope rows interleaved for Megatron's de-interleave (and yarn)
    "deepseek_v3_rope_halves": {
        **_BASE,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "head_dim": None,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "rope_interleave": False,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    # sinks, a 4-token window on layers 0 and 2 (SEQ is 8), q/k/v/o biases, a biased
    # router, stacked biased experts (pieces with a stride and a transpose), the clamped
    # SwiGLU with a limit the activations reach, the published yarn rope (truncate false)
    "gpt_oss": {
        **_BASE,
        "model_type": "gpt_oss",
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "swiglu_limit": 0.3,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    # gated delta net on layers 0-2 (two key heads of 16, four value heads of 8), gated
    # full attention on layer 3 (a quarter of each head rotated); routed experts and the
    # gated shared expert, a dense MLP on layer 1; (1 + w) norms
    "qwen3_next": {
        **_BASE,
        "model_type": "qwen3_next",
        **_LINEAR,
        **_GATED_MOE,
        "mlp_only_layers": [1],
    },
    # Qwen3.5: the same layers with the linear attention's projections split
    "qwen3_5_text": {**_BASE, "model_type": "qwen3_5_text", **_LINEAR},
    "qwen3_5_moe_text": {
        **{k: v for k, v in _BASE.items() if k != "intermediate_size"},
        "model_type": "qwen3_5_moe_text",
        **_LINEAR,
        **_GATED_MOE,
    },
    # MoE on layers 1 and 3, dense MLP on layers 0 and 2
    "qwen3_moe": {
        **_BASE,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [0, 2],
    },
}

#: strategy name -> ParallelDims fields (dp fills the 4 ranks). Megatron's etp defaults
#: to tp, so a MoE ``t2`` has etp=2.
STRATEGIES: dict[str, dict[str, int]] = {
    "t1": {"dp": 4},
    "t2": {"dp": 2, "tp": 2},
    "p2": {"dp": 2, "pp": 2},
    "e2": {"dp": 4, "ep": 2},
    "t2-moe": {"dp": 2, "tp": 2, "etp": 2},
    "t2p2": {"tp": 2, "pp": 2},
    "t2p2-moe": {"tp": 2, "pp": 2, "etp": 2},
    "p2v2": {"dp": 2, "pp": 2, "vpp": 2},
    "t2-etp1": {"dp": 2, "tp": 2, "etp": 1},  # experts whole on every TP rank
    "p2e2": {"dp": 2, "pp": 2, "ep": 2},
}

CASES: list[tuple[str, str]] = [
    (family, strategy)
    for family in ("qwen2", "qwen3", "llama_tied", "llama_untied")
    for strategy in ("t1", "t2", "p2")
]
CASES += [
    ("qwen3_moe", "t1"),
    ("qwen3_moe", "e2"),
    ("qwen3_moe", "t2-moe"),
    ("qwen3_moe", "p2"),
    ("llama_tied", "t2p2"),
    ("qwen2", "p2v2"),
]
# the newer families: t1, t2, e2 (MoE), p2 and one mixed case each
CASES += [
    ("mistral", "t1"),
    ("mistral", "t2"),
    ("mistral", "p2"),
    ("mistral", "t2p2"),
    ("mixtral", "t1"),
    ("mixtral", "t2-moe"),
    ("mixtral", "e2"),
    ("mixtral", "p2"),
    ("mixtral", "t2p2-moe"),
    ("glm4_moe", "t1"),
    ("glm4_moe", "e2"),
    ("glm4_moe", "t2-moe"),
    ("glm4_moe", "p2"),
    ("glm4_moe", "p2e2"),
    ("deepseek_v3", "t1"),
    ("deepseek_v3", "t2-moe"),
    ("deepseek_v3", "e2"),
    ("deepseek_v3", "p2"),
    ("deepseek_v3_noq", "t2p2-moe"),
    ("gpt_oss", "t1"),
    ("gpt_oss", "t2-etp1"),
    ("gpt_oss", "e2"),
    ("gpt_oss", "p2"),
    ("gpt_oss", "p2e2"),
    ("deepseek_v3_rope_halves", "t1"),
    ("deepseek_v3_rope_halves", "t2-moe"),
    ("qwen3_next", "t1"),
    ("qwen3_next", "t2-moe"),
    ("qwen3_next", "p2"),
    ("qwen3_next", "e2"),
    ("qwen3_next", "t2p2-moe"),
    ("qwen3_next", "p2v2"),  # one layer a chunk: linear, linear | linear, full
    ("qwen3_5_text", "t1"),
    ("qwen3_5_text", "t2"),
    ("qwen3_5_text", "p2"),
    ("qwen3_5_moe_text", "t2-moe"),
    ("qwen3_5_moe_text", "p2e2"),
]

SEQ = 8
BATCH = 2
NOISE = 0.02


def case_name(family: str, strategy: str) -> str:
    return f"{family}-{strategy.removesuffix('-moe').removesuffix('-etp1')}"


def arch_of(spec: ModelSpec) -> dict[str, Any]:
    """The ``megatron_build`` architecture mapping of a model spec."""
    moe = spec.is_moe
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
        "qk_norm": spec.qk_norm,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "num_experts": spec.num_experts if moe else None,
        "moe_intermediate_size": spec.moe_intermediate_size if moe else None,
        "num_experts_per_tok": spec.num_experts_per_tok if moe else None,
        "norm_topk_prob": spec.norm_topk_prob if moe else None,
        "moe_layer_pattern": [int(m) for m in spec.moe_layers] if moe else None,
        "num_shared_experts": spec.num_shared_experts,
        "router_score": spec.router_score,
        "router_bias": spec.router_bias,
        "router_groups": spec.router_groups,
        "router_group_topk": spec.router_group_topk,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "rotary_fraction": spec.rotary_fraction,
        "rope_scaling": spec.rope_scaling,
        "kv_lora_rank": spec.kv_lora_rank,
        "q_lora_rank": spec.q_lora_rank,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "model_type": spec.model_type,
        "o_bias": spec.o_bias,
        "mlp_bias": spec.mlp_bias,
        "attention_sinks": spec.has_sinks,
        "sliding_window": spec.sliding_window,
        "sliding_layers": spec.sliding_layers,
        "swiglu_alpha": spec.swiglu_alpha,
        "swiglu_limit": spec.swiglu_limit,
        "gated_delta": spec.family.serving.megatron_gated_delta,
        "linear_attention": spec.linear_attention,
        "shared_expert_size": spec.shared_expert_size,
    }


def sizes_of(dims: ParallelDims, *, moe: bool = False) -> MegatronSizes:
    """Megatron's sizes for ``dims`` (``etp=None``: Megatron's default, etp = tp; for an
    MoE model an etp of 1 under tp > 1 is passed as such)."""
    explicit = moe and dims.tp > 1 and dims.etp == 1 and dims.ep == 1
    return MegatronSizes(
        tp=dims.tp,
        pp=dims.pp,
        cp=dims.cp,
        ep=dims.ep,
        etp=None if dims.ep == 1 and dims.etp in (1, dims.tp) and not explicit else dims.etp,
        vpp=dims.vpp,
    )


# ------------------------------------------------------------- HF reference


def _hf_model(spec: ModelSpec, seed: int) -> Any:
    import transformers

    cfg = spec.hf_config()
    model_type = str(cfg.pop("model_type"))
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        # non-trivial values everywhere: norm weights near 1, biases non-zero
        for name, param in model.named_parameters():
            if spec.linear_attention is not None and _zero_centred(name):
                param.copy_(0.1 * torch.randn_like(param))  # (1 + w) norms: w near 0
            elif name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a non-zero score correction
                buf.copy_(0.05 * torch.randn_like(buf))
    return model.eval()


def _zero_centred(name: str) -> bool:
    """A ``(1 + w)`` norm of the gated-delta-net families: every norm but the linear
    attention's gated ``linear_attn.norm`` (a plain ``w``)."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def _hf_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _hf_reference(
    family: str, spec: ModelSpec, input_ids: torch.Tensor, cache: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Canonical tensors (every rank) and HF logits (rank 0), built once per family."""
    from areal_fn.model.hf_memory import hf_state_to_canonical

    if family not in cache:
        payload: list[Any] = [None]
        logits = None
        if dist.get_rank() == 0:
            model = _hf_model(spec, seed=7)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            payload[0] = {k: v.clone() for k, v in hf_state_to_canonical(state, spec).items()}
            logits = _hf_logits(model, input_ids)
        dist.broadcast_object_list(payload, src=0)
        cache[family] = (payload[0], logits)
    canonical, logits = cache[family]
    return canonical, logits


# ----------------------------------------------------------------- Megatron


def _chunk_prefix(v: int, n: int) -> str:
    return f"model{v}." if n > 1 else ""


def _stored(chunk: Any) -> dict[str, torch.Tensor]:
    """A chunk's parameters and the persistent buffers it saves (a router's expert bias)."""
    keys = set(chunk.state_dict())
    out = dict(chunk.named_parameters())
    out.update({n: b for n, b in chunk.named_buffers() if n in keys})
    return out


def _load(chunks: list[Any], state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Load one rank's converted state into its chunks; check nothing is left out."""
    seen: set[str] = set()
    missing_all: list[str] = []
    for v, chunk in enumerate(chunks):
        prefix = _chunk_prefix(v, len(chunks))
        sub = {k[len(prefix) :]: t for k, t in state.items() if k.startswith(prefix)}
        seen.update(prefix + k for k in sub)
        params = set(_stored(chunk))
        if set(sub) != params:
            raise AssertionError(
                f"rank {dist.get_rank()} chunk {v}: converted-not-parameter "
                f"{sorted(set(sub) - params)[:5]}, parameter-not-converted "
                f"{sorted(params - set(sub))[:5]}"
            )
        result = chunk.load_state_dict(sub, strict=False)
        bad = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if bad or result.unexpected_keys:
            raise AssertionError(
                f"load_state_dict: missing {bad[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        missing_all += result.missing_keys
        for name, param in _stored(chunk).items():
            if not torch.equal(param.detach(), sub[name]):
                raise AssertionError(f"{prefix}{name} did not load bitwise")
    if seen != set(state):
        raise AssertionError(f"converted tensors no chunk took: {sorted(set(state) - seen)[:5]}")
    return {"loaded": len(state), "missing_extra_state": len(missing_all)}


def _padding_rows(chunks: list[Any], vocab: int) -> float | None:
    """Max |value| of this rank's padded vocabulary rows (None when it holds none)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    worst: float | None = None
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name not in ("embedding.word_embeddings.weight", "output_layer.weight"):
                continue
            rows = param.shape[0]
            start = tp_rank * rows
            pad_from = max(0, min(rows, vocab - start))
            if pad_from < rows:
                value = float(param.detach()[pad_from:].abs().max())
                worst = value if worst is None else max(worst, value)
    return worst


def _megatron_logits(chunks: list[Any], input_ids: torch.Tensor) -> torch.Tensor | None:
    from megatron.core import parallel_state as ps

    logits: torch.Tensor | None
    if ps.get_pipeline_model_parallel_world_size() == 1:
        logits = forward_logits(chunks[0], input_ids)
    else:
        logits = pipeline_forward_logits(chunks, input_ids)
    return None if logits is None else gather_tp_logits(logits)


def _on_rank0(value: Any) -> list[Any] | None:
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def _gather_logits(logits: torch.Tensor | None) -> torch.Tensor | None:
    """Full-vocabulary logits from the last stage, on rank 0 (None elsewhere)."""
    got = _on_rank0(logits)
    if got is None:
        return None
    found = [t for t in got if t is not None]
    for t in found[1:]:
        if not torch.equal(t, found[0]):
            raise AssertionError("last-stage ranks disagree on the logits")
    return found[0]


def _local_state(chunks: list[Any]) -> dict[str, torch.Tensor]:
    return {
        _chunk_prefix(v, len(chunks)) + name: param.detach().clone()
        for v, chunk in enumerate(chunks)
        for name, param in _stored(chunk).items()
    }


def _mean_over(tensor: torch.Tensor, group: Any) -> None:
    size = dist.get_world_size(group)
    if size > 1:
        dist.all_reduce(tensor, group=group)
        tensor.div_(size)


def _perturb(chunks: list[Any], seed: int) -> None:
    """Add noise to every parameter, identical on every replica of it.

    Each rank draws its own noise, then averages it over the groups that hold copies:
    data parallel (expert data parallel for experts), tensor parallel (expert tensor
    parallel) for parameters Megatron does not partition, and the embedding group for
    tied embeddings split across pipeline stages.
    """
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for chunk in chunks:
            for name, param in _stored(chunk).items():  # a router's expert bias too
                noise = torch.randn(param.shape, generator=gen) * NOISE
                partitioned = bool(getattr(param, "tensor_model_parallel", False))
                if ".mlp.experts." in name:
                    _mean_over(noise, ps.get_expert_data_parallel_group())
                    if not partitioned:
                        _mean_over(noise, ps.get_expert_tensor_parallel_group())
                else:
                    _mean_over(noise, ps.get_data_parallel_group(with_context_parallel=True))
                    if not partitioned:
                        _mean_over(noise, ps.get_tensor_model_parallel_group())
                param.add_(noise)
        # tied embeddings across stages: first stage's embedding == last stage's output
        for chunk in chunks:
            tied = chunk.share_embeddings_and_output_weights and (
                chunk.pre_process or chunk.post_process
            )
            if tied and ps.get_pipeline_model_parallel_world_size() > 1:
                weight = chunk.shared_embedding_or_output_weight()
                _mean_over(weight.data, ps.get_embedding_group())


# --------------------------------------------------------------------- cases


def _replica_mismatches(
    states: Mapping[int, Mapping[str, torch.Tensor]],
    layout: Any,
    canonical: Mapping[str, torch.Tensor],
) -> list[str]:
    """Every rank's every piece against the exported canonical tensors (all holders)."""
    bad = []
    for r, state in states.items():
        for lt in layout.local_tensors(r):
            for p in lt.pieces:
                if p.canonical is None:
                    continue
                # the piece's canonical elements (strided and permuted for gpt-oss experts)
                want = canonical_region(canonical[p.canonical], p)
                held = state[lt.name][p.local_box.slices()].reshape(want.shape)
                if not torch.equal(held, want):
                    bad.append(f"rank {r} {lt.name} {p.canonical}{p.canonical_region}")
    return bad


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def run_case(
    family: str,
    strategy: str,
    input_ids: torch.Tensor,
    cache: dict[str, Any],
    tmp: Path,
) -> dict[str, Any] | None:
    import transformers

    rank = dist.get_rank()
    start = time.perf_counter()
    spec = model_from_hf_config(FAMILIES[family])
    dims = ParallelDims(**STRATEGIES[strategy])
    layout = megatron_layout(spec, dims)  # Megatron's default vocab padding (128 * tp)
    vpad = next(t.shape[0] for t in layout.tensors if t.name.endswith("word_embeddings.weight"))
    canonical, hf_logits = _hf_reference(family, spec, input_ids, cache)
    arch = arch_of(spec)
    record: dict[str, Any] = {
        "case": case_name(family, strategy),
        "family": family,
        "strategy": str(dims),
        "padded_vocab": vpad,
    }
    sizes = sizes_of(dims, moe=spec.is_moe)
    with megatron_session(sizes, seed=1234):
        config = transformer_config(arch, sizes)
        chunks = build_model_chunks(arch, config, vocab_size=vpad)
        # 1. HF -> Megatron through our conversion
        t0 = time.perf_counter()
        state = to_megatron(canonical, layout, rank)
        convert_s = time.perf_counter() - t0
        load_info = _load(chunks, state)
        padding = _on_rank0(_padding_rows(chunks, spec.vocab_size))
        logits = _gather_logits(_megatron_logits(chunks, input_ids))
        # 2. Megatron -> HF, unchanged: bitwise the canonical tensors
        states = _on_rank0(_local_state(chunks))
        if rank == 0:
            assert states is not None and logits is not None and hf_logits is not None
            assert padding is not None
            back = to_hf(dict(enumerate(states)), layout)
            unequal = [n for n in canonical if not torch.equal(back[n], canonical[n])]
            record.update(
                load_info,
                to_megatron_s=round(convert_s, 4),
                logits_shape=list(logits.shape),
                hf_logits_max_abs=float(hf_logits.abs().max()),
                forward_max_abs_diff=_max_abs(logits[..., : spec.vocab_size], hf_logits),
                padded_logits_max_abs=float(logits[..., spec.vocab_size :].abs().max()),
                padding_rows_max_abs=max((p for p in padding if p is not None), default=None),
                roundtrip_tensors=len(back),
                roundtrip_unequal=unequal,
            )
        # 3. perturb Megatron, export, load into transformers
        _perturb(chunks, seed=CASES.index((family, strategy)) + 1)
        logits_after = _gather_logits(_megatron_logits(chunks, input_ids))
        states = _on_rank0(_local_state(chunks))
        if rank == 0:
            assert states is not None and logits_after is not None
            t0 = time.perf_counter()
            exported = to_hf(dict(enumerate(states)), layout)
            export_s = time.perf_counter() - t0
            replicas = _replica_mismatches(dict(enumerate(states)), layout, exported)
            path = tmp / record["case"]
            from areal_fn.runtime.hf.io import write_hf_checkpoint

            write_hf_checkpoint(path, exported, model=spec, max_shard_bytes=256 << 10)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
            hf_after = _hf_logits(model, input_ids)
            shutil.rmtree(path)
            changed = sum(not torch.equal(exported[n], canonical[n]) for n in canonical)
            record.update(
                to_hf_s=round(export_s, 4),
                perturbed_tensors=changed,
                replica_mismatches=replicas[:10],
                perturbation_logit_shift=_max_abs(logits_after, logits)
                if logits is not None
                else None,
                reverse_max_abs_diff=_max_abs(logits_after[..., : spec.vocab_size], hf_after),
                reverse_logits_max_abs=float(hf_after.abs().max()),
            )
    dist.barrier()
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record if rank == 0 else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    wanted = [c for c in CASES if not args.cases or case_name(*c) in args.cases.split(",")]
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    init_distributed()
    input_ids = torch.randint(
        0, _BASE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    cache: dict[str, Any] = {}
    records = []
    start = time.perf_counter()
    # process groups held before the first session, then groups and threads (native
    # ones too) after each: every megatron_session destroys the groups it made
    held: dict[str, list[int]] = {"groups": [len(distributed_c10d._world.pg_map)], "threads": []}
    tmp = args.out / "hf"
    try:
        for family, strategy in wanted:
            record = run_case(family, strategy, input_ids, cache, tmp)
            held["groups"].append(len(distributed_c10d._world.pg_map))
            held["threads"].append(len(os.listdir("/proc/self/task")))
            if record is not None:
                records.append(record)
                print(json.dumps(record), flush=True)
        if dist.get_rank() == 0:
            from importlib.metadata import version

            report = {
                "world_size": dist.get_world_size(),
                "megatron_core": version("megatron-core"),
                "torch": torch.__version__,
                "transformers": version("transformers"),
                "input_ids": input_ids.tolist(),
                "seconds": round(time.perf_counter() - start, 2),
                **held,
                "cases": records,
            }
            (args.out / "report.json").write_text(json.dumps(report, indent=1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
