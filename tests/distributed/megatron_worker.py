"""torchrun worker: build tiny Megatron-Core GPTModels on CPU and record what they are.

Launched once by ``tests/distributed/test_megatron_cpu.py`` with 4 ranks (gloo). For every
case (model family x parallel strategy) each rank writes ``<out>/<case>/rank<r>.json``:
its parallel ranks and groups, every model chunk's local parameter names and shapes,
``state_dict`` keys, ``sharded_state_dict`` entries (global keys, shapes, offsets,
replica ids), which global experts it holds, and the result of a forward pass. Rank 0
writes ``<out>/manifest.json`` last.

The forward pass also checks logits against a Hugging Face ``transformers`` model of
the same family holding the same weights (eager attention, fp32). The weights are
copied into the Megatron model by the small ad-hoc conversion below; it exists only
to validate the CPU runtime and is not the library's conversion layer.
"""

import argparse
import json
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_fn.runtime.megatron.build import (
    MegatronSizes,
    build_model_chunks,
    forward_logits,
    gather_tp_logits,
    init_distributed,
    local_layer_offsets,
    megatron_session,
    pipeline_forward_logits,
    transformer_config,
)
from areal_fn.runtime.megatron.context import split_for_cp

# ----------------------------------------------------------------- families

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "qkv_bias": False,
    "qk_norm": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "num_experts": None,
    "moe_intermediate_size": None,
    "num_experts_per_tok": None,
    "norm_topk_prob": None,
    "moe_layer_pattern": None,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {**_BASE, "hf": "qwen2", "qkv_bias": True},
    # head_dim (32) != hidden_size / num_attention_heads (16): explicit kv_channels
    "qwen3": {**_BASE, "hf": "qwen3", "qk_norm": True, "head_dim": 32},
    "llama_tied": {
        **_BASE,
        "hf": "llama",
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
        "rope_theta": 500_000.0,
    },
    "llama_untied": {**_BASE, "hf": "llama", "rope_theta": 500_000.0},
    "qwen3_moe": {
        **_BASE,
        "hf": "qwen3_moe",
        "qk_norm": True,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "mistral": {**_BASE, "hf": "mistral", "head_dim": None},
    # every layer sparse; experts intermediate_size wide; top-k renormalised
    "mixtral": {
        **_BASE,
        "hf": "mixtral",
        "intermediate_size": 32,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    # dense layer 0, then sigmoid routing with an expert bias, two groups (one kept),
    # scaled weights, one shared expert; q/k/v biases, q/k norms, half the dims rotated
    "glm4_moe": {
        **_BASE,
        "hf": "glm4_moe",
        "qkv_bias": True,
        "qk_norm": True,
        "num_experts": 4,
        "moe_intermediate_size": 16,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_layer_pattern": [0, 1, 1, 1],
        "num_shared_experts": 1,
        "router_score": "sigmoid",
        "router_bias": True,
        "router_groups": 2,
        "router_group_topk": 1,
        "routed_scaling_factor": 2.5,
        "rotary_fraction": 0.5,
    },
    # multi-latent attention (query LoRA, plain rope), dense layer 0, sigmoid routing with
    # an expert bias, two groups, a shared expert
    "deepseek_v3": {
        **_BASE,
        "hf": "deepseek_v3",
        "num_key_value_heads": 4,
        "head_dim": 24,  # qk_nope 16 + qk_rope 8
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "num_experts": 4,
        "moe_intermediate_size": 16,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_layer_pattern": [0, 1, 1, 1],
        "num_shared_experts": 1,
        "router_score": "sigmoid",
        "router_bias": True,
        "router_groups": 2,
        "router_group_topk": 1,
        "routed_scaling_factor": 2.5,
    },
    # attention sinks, a 4-token window on layers 0 and 2, q/k/v/o biases, a biased
    # router, stacked biased experts, the clamped SwiGLU, the published yarn rope
    "gpt_oss": {
        **_BASE,
        "hf": "gpt_oss",
        "model_type": "gpt_oss",
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "attention_sinks": True,
        "sliding_window": 4,
        "sliding_layers": [True, False, True, False],
        "swiglu_alpha": 1.702,
        "swiglu_limit": 0.3,
        "rope_theta": 150_000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "intermediate_size": 32,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    # dense MLP on layers 0 and 2 (HF mlp_only_layers=[0, 2])
    "qwen3_moe_mixed": {
        **_BASE,
        "hf": "qwen3_moe",
        "qk_norm": True,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_layer_pattern": [0, 1, 0, 1],
    },
    # gated delta net on layers 0-2, gated attention on layer 3 (a quarter of each head
    # rotated), (1 + w) norms; routed experts and the gated shared expert, dense layer 1
    "qwen3_next": {
        **_BASE,
        "hf": "qwen3_next",
        "qk_norm": True,
        "rotary_fraction": 0.25,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_layer_pattern": [1, 0, 1, 1],
        "gated_delta": True,
        "linear_attention": {
            "key_heads": 2,
            "value_heads": 4,
            "key_head_dim": 16,
            "value_head_dim": 8,
            "conv_kernel": 4,
            "layers": [True, True, True, False],
        },
        "shared_expert_size": 48,
    },
}
# one multi-token-prediction layer (Megatron-Core's MTP block on the last stage)
FAMILIES["deepseek_v3_mtp"] = {**FAMILIES["deepseek_v3"], "mtp_layers": 1}
FAMILIES["glm4_moe_mtp"] = {**FAMILIES["glm4_moe"], "mtp_layers": 1}


def _case(
    name: str,
    family: str,
    sizes: dict[str, Any],
    config: dict[str, Any] | None = None,
    *,
    mode: str = "forward",
) -> dict[str, Any]:
    # mode: "forward" (build, record, forward + HF parity), "expect_error" (record the
    # error the build raises), "grouped_structure" (build the legacy GroupedMLP with its
    # kernel check bypassed: names and shapes only, no forward), "structure" (names and
    # shapes only: the MTP layers, which transformers has no module for).
    return {"name": name, "family": family, "sizes": sizes, "config": config or {}, "mode": mode}


STRATEGIES: dict[str, dict[str, Any]] = {
    "t2": {"tp": 2},
    "p2": {"pp": 2},
    "t2p2": {"tp": 2, "pp": 2},
    "p2v2": {"pp": 2, "vpp": 2},
}

CASES: list[dict[str, Any]] = [
    _case(f"{family}-{strategy}", family, sizes)
    for family in ("qwen2", "qwen3", "llama_tied", "llama_untied")
    for strategy, sizes in STRATEGIES.items()
]
CASES += [
    _case("qwen2-d4", "qwen2", {}),
    _case("qwen2-p2-first1", "qwen2", {"pp": 2}, {"num_layers_in_first_pipeline_stage": 1}),
    _case("qwen2-p2-layout", "qwen2", {"pp": 2}, {"pipeline_model_parallel_layout": "Et|tttL"}),
    _case(
        "llama_tied-p2v2-layout",
        "llama_tied",
        {"pp": 2, "vpp": 2},
        {"pipeline_model_parallel_layout": "Et|t|t|tL"},
    ),
    _case("qwen3_moe-e2", "qwen3_moe", {"ep": 2}),
    _case("qwen3_moe-e4", "qwen3_moe", {"ep": 4}),
    _case("qwen3_moe-t2e2", "qwen3_moe", {"tp": 2, "ep": 2}),
    _case("qwen3_moe-t2e2x1", "qwen3_moe", {"tp": 2, "ep": 2, "etp": 1}),
    _case("qwen3_moe-p2e2", "qwen3_moe", {"pp": 2, "ep": 2}),
    _case("qwen3_moe_mixed-e2", "qwen3_moe_mixed", {"ep": 2}),
    # the newer families, one launch's worth: TP, TP with EP, PP with EP
    _case("mistral-t2", "mistral", {"tp": 2}),
    _case("mixtral-t2e2x1", "mixtral", {"tp": 2, "ep": 2, "etp": 1}),
    _case("glm4_moe-t2e2x1", "glm4_moe", {"tp": 2, "ep": 2, "etp": 1}),
    _case("glm4_moe-p2e2", "glm4_moe", {"pp": 2, "ep": 2}),
    _case("deepseek_v3-t2e2x1", "deepseek_v3", {"tp": 2, "ep": 2, "etp": 1}),
    _case("gpt_oss-t2e2x1", "gpt_oss", {"tp": 2, "ep": 2, "etp": 1}),
    # and PP, VPP, expert TP: each family under a second and a third strategy
    _case("mistral-p2v2", "mistral", {"pp": 2, "vpp": 2}),
    _case("mistral-t2p2", "mistral", {"tp": 2, "pp": 2}),
    _case("mixtral-t2e2", "mixtral", {"tp": 2, "ep": 2}),
    _case("mixtral-p2e2", "mixtral", {"pp": 2, "ep": 2}),
    _case("glm4_moe-t2e2", "glm4_moe", {"tp": 2, "ep": 2}),
    _case("glm4_moe-p2v2", "glm4_moe", {"pp": 2, "vpp": 2}),
    _case("deepseek_v3-t2e2", "deepseek_v3", {"tp": 2, "ep": 2}),
    _case("deepseek_v3-p2e2", "deepseek_v3", {"pp": 2, "ep": 2}),
    _case("deepseek_v3-p2v2", "deepseek_v3", {"pp": 2, "vpp": 2}),
    _case("gpt_oss-p2e2", "gpt_oss", {"pp": 2, "ep": 2}),
    _case("gpt_oss-p2v2", "gpt_oss", {"pp": 2, "vpp": 2}),
    _case(
        "deepseek_v3_mtp-t2e2x1", "deepseek_v3_mtp", {"tp": 2, "ep": 2, "etp": 1}, mode="structure"
    ),
    _case("deepseek_v3_mtp-p2e2", "deepseek_v3_mtp", {"pp": 2, "ep": 2}, mode="structure"),
    _case("glm4_moe_mtp-t2p2v2", "glm4_moe_mtp", {"tp": 2, "pp": 2, "vpp": 2}, mode="structure"),
    # Megatron-Core's GatedDeltaNet (our local block); logits: conversion_worker.py
    _case("qwen3_next-t2e2x1", "qwen3_next", {"tp": 2, "ep": 2, "etp": 1}, mode="structure"),
    _case("qwen3_next-p2e2", "qwen3_next", {"pp": 2, "ep": 2}, mode="structure"),
    # the MTP layer and the loss alone in the last chunk, the final norm in chunk 2
    _case(
        "glm4_moe_mtp-p2v2-layout",
        "glm4_moe_mtp",
        {"pp": 2, "vpp": 2},
        {"pipeline_model_parallel_layout": "Ett|t|t|mL"},
        mode="structure",
    ),
    _case(
        "qwen3_moe-e2-grouped",
        "qwen3_moe",
        {"ep": 2},
        {"moe_grouped_gemm": True},
        mode="expect_error",
    ),
    # context parallelism: the local spec's DotProductAttention refuses cp > 1, the
    # core attention of areal_fn.runtime.megatron.context runs it
    _case("qwen2-c2", "qwen2", {"cp": 2}),
    _case("qwen2-t2c2", "qwen2", {"tp": 2, "cp": 2}),
    _case(
        "qwen3_moe-t2e2-grouped-structure",
        "qwen3_moe",
        {"tp": 2, "ep": 2},
        {"moe_grouped_gemm": True},
        mode="grouped_structure",
    ),
]

# ------------------------------------------------------------ HF reference


def _hf_model(arch: Mapping[str, Any], seed: int) -> Any:
    import transformers

    common = {
        "hidden_size": arch["hidden_size"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_key_value_heads"],
        "head_dim": arch["head_dim"] or arch["hidden_size"] // arch["num_attention_heads"],
        "intermediate_size": arch["intermediate_size"],
        "vocab_size": arch["vocab_size"],
        "max_position_embeddings": arch["max_position_embeddings"],
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": arch["rope_theta"],
        "tie_word_embeddings": arch["tie_word_embeddings"],
        "hidden_act": "silu",
    }
    kind = arch["hf"]
    config: Any
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, use_sliding_window=False)
    elif kind == "llama":
        config = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            **common,
            num_local_experts=arch["num_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    elif kind == "glm4_moe":
        pattern = arch["moe_layer_pattern"]
        config = transformers.Glm4MoeConfig(
            **common,
            attention_bias=arch["qkv_bias"],
            use_qk_norm=arch["qk_norm"],
            partial_rotary_factor=arch["rotary_fraction"],
            n_routed_experts=arch["num_experts"],
            moe_intermediate_size=arch["moe_intermediate_size"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            norm_topk_prob=arch["norm_topk_prob"],
            n_shared_experts=arch["num_shared_experts"],
            n_group=arch["router_groups"],
            topk_group=arch["router_group_topk"],
            routed_scaling_factor=arch["routed_scaling_factor"],
            first_k_dense_replace=pattern.index(1),
        )
    elif kind == "deepseek_v3":
        rope = arch["qk_rope_head_dim"]
        config = transformers.DeepseekV3Config(
            **{k: v for k, v in common.items() if k != "head_dim"},
            q_lora_rank=arch["q_lora_rank"],
            kv_lora_rank=arch["kv_lora_rank"],
            qk_nope_head_dim=arch["head_dim"] - rope,
            qk_rope_head_dim=rope,
            v_head_dim=arch["v_head_dim"],
            n_routed_experts=arch["num_experts"],
            moe_intermediate_size=arch["moe_intermediate_size"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            norm_topk_prob=arch["norm_topk_prob"],
            n_shared_experts=arch["num_shared_experts"],
            n_group=arch["router_groups"],
            topk_group=arch["router_group_topk"],
            routed_scaling_factor=arch["routed_scaling_factor"],
            first_k_dense_replace=arch["moe_layer_pattern"].index(1),
        )
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(
            **{k: v for k, v in common.items() if k != "rope_theta"},
            num_local_experts=arch["num_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            sliding_window=arch["sliding_window"],
            layer_types=[
                "sliding_attention" if s else "full_attention" for s in arch["sliding_layers"]
            ],
            swiglu_limit=arch["swiglu_limit"],
            rope_parameters={**arch["rope_scaling"], "rope_theta": arch["rope_theta"]},
        )
    elif kind == "qwen3_moe":
        pattern = arch["moe_layer_pattern"] or [1] * arch["num_layers"]
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=arch["num_experts"],
            moe_intermediate_size=arch["moe_intermediate_size"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            norm_topk_prob=arch["norm_topk_prob"],
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        )
    else:
        raise ValueError(f"unknown HF family {kind!r}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        # Non-trivial values everywhere (norm weights near 1, biases non-zero).
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a non-zero score correction
                buf.copy_(0.05 * torch.randn_like(buf))
    return model.eval()


def _hf_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


# ----------------------------------------------- ad-hoc HF -> Megatron weights


def _chunk(tensor: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    return torch.chunk(tensor, parts, dim=dim)[index]


def _qkv_interleaved(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Mapping[str, Any]
) -> torch.Tensor:
    """Megatron's linear_qkv rows: per KV group g, [q heads of g; k_g; v_g]."""
    groups = arch["num_key_value_heads"]
    per_group = arch["num_attention_heads"] // groups
    d = arch["head_dim"] or arch["hidden_size"] // arch["num_attention_heads"]
    rows = []
    for g in range(groups):
        rows += [
            q[g * per_group * d : (g + 1) * per_group * d],
            k[g * d : (g + 1) * d],
            v[g * d : (g + 1) * d],
        ]
    return torch.cat(rows, dim=0)


def _megatron_tensor(
    name: str,
    hf: Mapping[str, torch.Tensor],
    arch: Mapping[str, Any],
    layer_offset: int,
    par: Mapping[str, int],
) -> torch.Tensor:
    """The local Megatron tensor ``name`` (this rank's shard) from HF weights."""
    tp, tpr = par["tp"], par["tp_rank"]
    etp, etpr = par["etp"], par["etp_rank"]
    if name == "embedding.word_embeddings.weight":
        return _chunk(hf["model.embed_tokens.weight"], tp, tpr, 0)
    if name == "output_layer.weight":
        key = "model.embed_tokens.weight" if arch["tie_word_embeddings"] else "lm_head.weight"
        return _chunk(hf[key], tp, tpr, 0)
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"]
    parts = name.split(".")
    assert parts[:2] == ["decoder", "layers"], name
    g = layer_offset + int(parts[2])
    rest = ".".join(parts[3:])
    p = f"model.layers.{g}."
    simple = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": p + "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": p + "self_attn.k_norm.weight",
        "mlp.router.weight": p + "mlp.gate.weight",
        "mlp.router.expert_bias": p + "mlp.gate.e_score_correction_bias",
    }
    if arch["hf"] == "deepseek_v3":  # MLA: every projection whole, Shard(0) but linear_proj
        mla = {
            "self_attention.linear_q_down_proj.weight": "q_a_proj",
            "self_attention.linear_q_up_proj.weight": "q_b_proj",
            "self_attention.linear_q_proj.weight": "q_proj",
            "self_attention.linear_kv_down_proj.weight": "kv_a_proj_with_mqa",
            "self_attention.linear_kv_up_proj.weight": "kv_b_proj",
        }
        if rest in mla:
            return _chunk(hf[f"{p}self_attn.{mla[rest]}.weight"], tp, tpr, 0)
        simple["self_attention.q_layernorm.weight"] = p + "self_attn.q_a_layernorm.weight"
        simple["self_attention.kv_layernorm.weight"] = p + "self_attn.kv_a_layernorm.weight"
    if arch["hf"] == "gpt_oss":
        gpt_oss = _gpt_oss_tensor(rest, p, hf, arch, par)
        if gpt_oss is not None:
            return gpt_oss
    if rest in simple:
        return hf[simple[rest]]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = rest.rsplit(".", 1)[1]
        q, k, v = (hf[f"{p}self_attn.{x}_proj.{suffix}"] for x in "qkv")
        fused = _qkv_interleaved(q, k, v, arch)
        return _chunk(fused, tp, tpr, 0)
    if rest == "self_attention.linear_proj.weight":
        return _chunk(hf[p + "self_attn.o_proj.weight"], tp, tpr, 1)
    if rest == "mlp.linear_fc1.weight":
        gate = _chunk(hf[p + "mlp.gate_proj.weight"], tp, tpr, 0)
        up = _chunk(hf[p + "mlp.up_proj.weight"], tp, tpr, 0)
        return torch.cat([gate, up], dim=0)
    if rest == "mlp.linear_fc2.weight":
        return _chunk(hf[p + "mlp.down_proj.weight"], tp, tpr, 1)
    if rest == "mlp.shared_experts.linear_fc1.weight":
        gate = _chunk(hf[p + "mlp.shared_experts.gate_proj.weight"], tp, tpr, 0)
        up = _chunk(hf[p + "mlp.shared_experts.up_proj.weight"], tp, tpr, 0)
        return torch.cat([gate, up], dim=0)
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return _chunk(hf[p + "mlp.shared_experts.down_proj.weight"], tp, tpr, 1)
    if rest.startswith("mlp.experts.local_experts."):
        local = int(parts[6])
        expert = par["ep_rank"] * (arch["num_experts"] // par["ep"]) + local
        gate_up = hf[p + "mlp.experts.gate_up_proj"][expert]
        inter = arch["moe_intermediate_size"]
        if rest.endswith("linear_fc1.weight"):
            gate = _chunk(gate_up[:inter], etp, etpr, 0)
            up = _chunk(gate_up[inter:], etp, etpr, 0)
            return torch.cat([gate, up], dim=0)
        if rest.endswith("linear_fc2.weight"):
            return _chunk(hf[p + "mlp.experts.down_proj"][expert], etp, etpr, 1)
    raise KeyError(f"no HF source for Megatron parameter {name!r}")


def _gpt_oss_tensor(
    rest: str,
    p: str,
    hf: Mapping[str, torch.Tensor],
    arch: Mapping[str, Any],
    par: Mapping[str, int],
) -> torch.Tensor | None:
    """gpt-oss's own tensors: sinks by head, the output bias, the biased router, and the
    experts out of the stacked ``gate_up_proj [E, H, 2I]`` (gate/up interleaved columns,
    used as ``x @ W``) and ``down_proj [E, I, H]`` with their biases (etp 1)."""
    if rest == "self_attention.core_attention.softmax_offset":
        return _chunk(hf[p + "self_attn.sinks"], par["tp"], par["tp_rank"], 0)
    if rest == "self_attention.linear_proj.bias":
        return hf[p + "self_attn.o_proj.bias"]
    if rest in ("mlp.router.weight", "mlp.router.bias"):
        return hf[p + rest]
    if not rest.startswith("mlp.experts.local_experts."):
        return None
    local = int(rest.split(".")[3])
    e = par["ep_rank"] * (arch["num_experts"] // par["ep"]) + local
    if rest.endswith("linear_fc1.weight"):
        w = hf[p + "mlp.experts.gate_up_proj"][e]
        return torch.cat([w[:, 0::2].T, w[:, 1::2].T], dim=0)
    if rest.endswith("linear_fc1.bias"):
        b = hf[p + "mlp.experts.gate_up_proj_bias"][e]
        return torch.cat([b[0::2], b[1::2]], dim=0)
    if rest.endswith("linear_fc2.weight"):
        return hf[p + "mlp.experts.down_proj"][e].T
    if rest.endswith("linear_fc2.bias"):
        return hf[p + "mlp.experts.down_proj_bias"][e]
    return None


def _load_hf_weights(
    chunks: list[Any],
    offsets: list[int],
    hf: Mapping[str, torch.Tensor],
    arch: Mapping[str, Any],
    par: Mapping[str, int],
) -> None:
    with torch.no_grad():
        for chunk, offset in zip(chunks, offsets, strict=True):
            for name, param in chunk.named_parameters():
                src = _megatron_tensor(name, hf, arch, offset, par)
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{name}: HF-derived shape {tuple(src.shape)} != {tuple(param.shape)}"
                    )
                param.copy_(src)
            for name, buf in chunk.named_buffers():
                if name.endswith("mlp.router.expert_bias"):
                    buf.copy_(_megatron_tensor(name, hf, arch, offset, par))


# ---------------------------------------------------------------- recording


def _parallel_info() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    def ranks(group: Any) -> list[int]:
        return [int(r) for r in dist.get_process_group_ranks(group)]

    return {
        "ranks": {
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "cp": ps.get_context_parallel_rank(),
            "dp": ps.get_data_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(),
            "expert_dp": ps.get_expert_data_parallel_rank(),
        },
        "groups": {
            "tp": ranks(ps.get_tensor_model_parallel_group()),
            "pp": ranks(ps.get_pipeline_model_parallel_group()),
            "cp": ranks(ps.get_context_parallel_group()),
            "dp": ranks(ps.get_data_parallel_group()),
            "ep": ranks(ps.get_expert_model_parallel_group()),
            "etp": ranks(ps.get_expert_tensor_parallel_group()),
            "expert_dp": ranks(ps.get_expert_data_parallel_group()),
            "embedding": ranks(ps.get_embedding_group()),
        },
    }


def _par_for_conversion(info: Mapping[str, Any]) -> dict[str, int]:
    g, r = info["groups"], info["ranks"]
    return {
        "tp": len(g["tp"]),
        "tp_rank": r["tp"],
        "ep": len(g["ep"]),
        "ep_rank": r["ep"],
        "etp": len(g["etp"]),
        "etp_rank": r["etp"],
    }


def _sharded_entries(chunk: Any) -> list[dict[str, Any]]:
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    entries: list[dict[str, Any]] = []

    def visit(local_key: str, value: Any) -> None:
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            items = (
                built.items()
                if isinstance(built, dict)
                else enumerate(built if isinstance(built, list) else [built])
            )
            for sub_key, sub in items:
                visit(f"{local_key}/{sub_key}", sub)
        elif isinstance(value, ShardedTensor):
            entries.append(
                {
                    "local_key": local_key,
                    "key": value.key,
                    "local_shape": list(value.local_shape),
                    "global_shape": list(value.global_shape),
                    "global_offset": list(value.global_offset),
                    "axis_fragmentations": list(value.axis_fragmentations or ()),
                    "replica_id": list(value.replica_id)
                    if isinstance(value.replica_id, tuple)
                    else value.replica_id,
                    "prepend_axis_num": value.prepend_axis_num,
                }
            )
        elif isinstance(value, ShardedObject):
            entries.append({"local_key": local_key, "key": value.key, "object": True})
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{local_key}/{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                visit(f"{local_key}/{i}", v)

    metadata = None
    if getattr(chunk, "mtp_process", False):  # the MTP stage ties its embedding copy
        from megatron.core import parallel_state

        metadata = {
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)
        }
    for key, value in chunk.sharded_state_dict(metadata=metadata).items():
        visit(key, value)
    return entries


def _chunk_record(chunk: Any, offset: int, vp_stage: int | None) -> dict[str, Any]:
    experts = {
        name: [int(i) for i in module.local_expert_indices]
        for name, module in chunk.named_modules()
        if type(module).__name__ == "MoELayer"
    }
    # Sum of this rank's copy of the word embeddings (first stage) or of the tied output
    # layer (last stage): after the build, Megatron all-reduces the two copies.
    tied = bool(chunk.share_embeddings_and_output_weights)
    shared = chunk.shared_embedding_or_output_weight() if tied else None
    return {
        "shared_embedding_sum": None if shared is None else float(shared.detach().double().sum()),
        "vp_stage": vp_stage,
        "pre_process": bool(chunk.pre_process),
        "post_process": bool(chunk.post_process),
        "layer_offset": offset,
        "layer_numbers": [int(layer.layer_number) for layer in chunk.decoder.layers],
        "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in chunk.named_parameters()],
        # persistent buffers a checkpoint holds (the router's expert bias)
        "buffers": [
            [n, list(b.shape), str(b.dtype)]
            for n, b in chunk.named_buffers()
            if n in chunk.state_dict()
        ],
        "state_dict_keys": list(chunk.state_dict().keys()),
        "sharded": _sharded_entries(chunk),
        "experts": experts,
    }


@contextmanager
def _grouped_gemm_check_bypassed() -> Iterator[None]:
    # Structure only: lets the legacy GroupedMLP be constructed without the CUDA
    # grouped_gemm package, to record its parameter names and shapes.
    from megatron.core.transformer.moe import grouped_gemm_util

    original = grouped_gemm_util.assert_grouped_gemm_is_available
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        grouped_gemm_util.assert_grouped_gemm_is_available = original


def _sync_error(error: str | None) -> None:
    # Every rank must agree that the case failed the same way (or not at all).
    flags = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(flags)
    if int(flags.item()) not in (0, dist.get_world_size()):
        raise RuntimeError(f"ranks disagree on the build outcome: {error}")


def run_case(
    case: Mapping[str, Any], out: Path, input_ids: torch.Tensor, hf_cache: dict[str, Any]
) -> dict[str, Any]:
    arch = FAMILIES[case["family"]]
    sizes = MegatronSizes(**case["sizes"])
    rank = dist.get_rank()
    record: dict[str, Any] = {
        "case": case["name"],
        "family": case["family"],
        "arch": arch,
        "sizes": {
            "tp": sizes.tp,
            "pp": sizes.pp,
            "cp": sizes.cp,
            "ep": sizes.ep,
            "etp": sizes.expert_tp,
            "vpp": sizes.vpp,
            "dp": sizes.dp(dist.get_world_size()),
            "order": sizes.order,
        },
        "config": case["config"],
        "mode": case["mode"],
        "rank": rank,
        "world_size": dist.get_world_size(),
        "error": None,
        "forward": None,
    }
    start = time.perf_counter()
    with megatron_session(sizes, seed=1234):
        config = transformer_config(arch, sizes, **case["config"])
        record.update(_parallel_info())
        if case["mode"] == "expect_error":
            error = None
            try:
                build_model_chunks(arch, config)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            _sync_error(error)
            record["error"] = error
        else:
            bypass = _grouped_gemm_check_bypassed() if case["mode"] == "grouped_structure" else None
            with bypass or _nullcontext():
                chunks = build_model_chunks(arch, config)
            offsets = local_layer_offsets(config)
            record["chunks"] = [
                _chunk_record(c, o, None if len(chunks) == 1 else v)
                for v, (c, o) in enumerate(zip(chunks, offsets, strict=True))
            ]
            if case["mode"] == "forward":
                record["forward"] = _forward(
                    chunks, offsets, arch, case, input_ids, hf_cache, record
                )
    record["seconds"] = round(time.perf_counter() - start, 3)
    path = out / case["name"] / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield


def _forward(
    chunks: list[Any],
    offsets: list[int],
    arch: Mapping[str, Any],
    case: Mapping[str, Any],
    input_ids: torch.Tensor,
    hf_cache: dict[str, Any],
    record: Mapping[str, Any],
) -> dict[str, Any]:

    result: dict[str, Any] = {}
    family = case["family"]
    if family not in hf_cache:
        # Rank 0 alone imports transformers and runs the reference; the rest receive it.
        payload: list[Any] = [None]
        if dist.get_rank() == 0:
            model = _hf_model(arch, seed=7)
            payload[0] = (
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                _hf_logits(model, input_ids),
            )
        dist.broadcast_object_list(payload, src=0)
        hf_cache[family] = payload[0]
    hf_state, hf_logits = hf_cache[family]
    # 1. Megatron's own random initialisation: the forward runs and is finite (and,
    #    as a control for step 2, does not match the HF model).
    logits = _megatron_logits(chunks, input_ids)
    result["random_init"] = _describe(logits)
    if logits is not None:
        result["random_init"]["max_abs_diff_to_hf"] = float((logits - hf_logits).abs().max())
    # 2. HF weights copied in: logits agree with transformers.
    _load_hf_weights(chunks, offsets, hf_state, arch, _par_for_conversion(record))
    logits = _megatron_logits(chunks, input_ids)
    result["hf"] = _describe(logits)
    if logits is not None:
        result["hf"]["max_abs_diff"] = float((logits - hf_logits).abs().max())
        result["hf"]["hf_logits_max_abs"] = float(hf_logits.abs().max())
    # 3. One training forward-backward through Megatron's schedule (HF weights still in).
    try:
        result["train"] = _train_step(chunks, input_ids, hf_logits)
    except ValueError as exc:  # MoE + TP without sequence parallelism refuses training
        result["train"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def _train_step(
    chunks: list[Any], input_ids: torch.Tensor, hf_logits: torch.Tensor
) -> dict[str, Any]:
    """forward_backward (1 sample per micro-batch); per-token loss CE(logits_t, tokens_t)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = input_ids.shape
    # under context parallelism each rank runs its chunks of the row (the mask stays whole)
    position_ids = split_for_cp(torch.arange(seq).unsqueeze(0))
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    cp = ps.get_context_parallel_world_size()

    def step(data_iterator: Iterator[torch.Tensor], model: Any) -> tuple[Any, Any]:
        tokens = split_for_cp(next(data_iterator))
        output = model(tokens, position_ids, mask, labels=tokens)  # [1, seq/cp] token losses

        def loss_func(token_losses: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = token_losses.float().mean()
            report = loss.detach().clone()  # the schedule divides `loss` in place
            if cp > 1:  # every CP rank holds seq/cp tokens: the mean of the means
                dist.all_reduce(report, group=ps.get_context_parallel_group())
                report /= cp
            return loss, {"loss": report}

        return output, loss_func

    for chunk in chunks:
        chunk.train()
        chunk.zero_grad(set_to_none=True)
    micro = list(input_ids.split(1))
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=1,
            forward_only=False,
        )
    finally:
        for chunk in chunks:
            chunk.eval()
    grads = [p.grad for chunk in chunks for p in chunk.parameters()]
    reference = torch.nn.functional.cross_entropy(
        hf_logits.reshape(-1, hf_logits.shape[-1]), input_ids.reshape(-1), reduction="none"
    ).reshape(batch, seq)
    losses = [float(o["loss"]) for o in outputs]
    return {
        "error": None,
        "parameters": len(grads),
        "with_grad": sum(g is not None for g in grads),
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads if g is not None),
        "losses": losses,
        "hf_losses": [float(x) for x in reference.mean(dim=1)] if losses else [],
    }


def _megatron_logits(chunks: list[Any], input_ids: torch.Tensor) -> torch.Tensor | None:
    from megatron.core import parallel_state as ps

    logits: torch.Tensor | None
    if ps.get_pipeline_model_parallel_world_size() == 1:
        logits = forward_logits(chunks[0], input_ids)
    else:
        logits = pipeline_forward_logits(chunks, input_ids)
    return None if logits is None else gather_tp_logits(logits)


def _describe(logits: torch.Tensor | None) -> dict[str, Any]:
    if logits is None:
        return {"logits_shape": None, "finite": None}
    return {"logits_shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    wanted = [c for c in CASES if not args.cases or c["name"] in args.cases.split(",")]
    torch.set_num_threads(1)
    init_distributed()
    input_ids = torch.randint(
        0, _BASE["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0)
    )
    hf_cache: dict[str, Any] = {}
    summary = []
    try:
        for case in wanted:
            record = run_case(case, args.out, input_ids, hf_cache)
            summary.append({"case": case["name"], "seconds": record["seconds"]})
        dist.barrier()
        if dist.get_rank() == 0:
            manifest = {
                "world_size": dist.get_world_size(),
                "megatron_core": _version("megatron-core"),
                "torch": torch.__version__,
                "transformers": _version("transformers"),
                "input_ids": input_ids.tolist(),
                "cases": [dict(c) for c in wanted],
                "families": FAMILIES,
                "timing": summary,
            }
            (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _version(dist_name: str) -> str:
    from importlib.metadata import version

    return version(dist_name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
