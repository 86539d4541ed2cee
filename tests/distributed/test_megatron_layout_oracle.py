"""megatron_layout against what real Megatron-Core GPTModels hold on every rank.

The records come from one torchrun launch of real Megatron-Core on CPU (the
``megatron_ground_truth`` fixture of ``tests/distributed/conftest.py``); this module predicts
every rank's parameter names and shapes (and expert placement) with our pure layout
and requires exact agreement.
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.pipeline.partition import StagePlan
from areal_fn.strategy.allocation import ParallelDims

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("megatron_cpu")]

#: cases whose structure our layout predicts (legacy GroupedMLP names and refused cases excluded)
SKIP = ("grouped", "structure", "-c2")


def _hf_config(arch: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": arch["hf"],
        "hidden_size": arch["hidden_size"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_key_value_heads"],
        "head_dim": arch["head_dim"],
        "intermediate_size": arch["intermediate_size"],
        "vocab_size": arch["vocab_size"],
        "max_position_embeddings": arch["max_position_embeddings"],
        "tie_word_embeddings": arch["tie_word_embeddings"],
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": arch["rope_theta"],
        "torch_dtype": "float32",
    }
    if arch.get("mtp_layers"):
        cfg["num_nextn_predict_layers"] = arch["mtp_layers"]
    if arch["hf"] == "llama":
        cfg["attention_bias"] = arch["qkv_bias"]
    if arch["hf"] in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
        if arch["head_dim"] is None:
            del cfg["head_dim"]
    if arch["hf"] == "deepseek_v3":
        rope = arch["qk_rope_head_dim"]
        del cfg["head_dim"]
        cfg.update(
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
    elif arch["hf"] == "glm4_moe":
        cfg.update(
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
            first_k_dense_replace=arch["moe_layer_pattern"].index(1),
        )
    elif arch["hf"] == "gpt_oss":
        cfg.update(
            num_local_experts=arch["num_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            sliding_window=arch["sliding_window"],
            layer_types=[
                "sliding_attention" if s else "full_attention" for s in arch["sliding_layers"]
            ],
            swiglu_limit=arch["swiglu_limit"],
            rope_scaling=arch["rope_scaling"],
        )
    elif arch["hf"] == "qwen3_next":
        la = arch["linear_attention"]
        cfg.update(
            linear_num_key_heads=la["key_heads"],
            linear_num_value_heads=la["value_heads"],
            linear_key_head_dim=la["key_head_dim"],
            linear_value_head_dim=la["value_head_dim"],
            linear_conv_kernel_dim=la["conv_kernel"],
            layer_types=["linear_attention" if x else "full_attention" for x in la["layers"]],
            partial_rotary_factor=arch["rotary_fraction"],
            num_experts=arch["num_experts"],
            moe_intermediate_size=arch["moe_intermediate_size"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            norm_topk_prob=arch["norm_topk_prob"],
            shared_expert_intermediate_size=arch["shared_expert_size"],
            mlp_only_layers=[i for i, m in enumerate(arch["moe_layer_pattern"]) if not m],
        )
    elif arch["hf"] == "mixtral":
        cfg.update(
            num_local_experts=arch["num_experts"], num_experts_per_tok=arch["num_experts_per_tok"]
        )
    elif arch["num_experts"]:
        cfg.update(
            num_experts=arch["num_experts"],
            moe_intermediate_size=arch["moe_intermediate_size"],
            num_experts_per_tok=arch["num_experts_per_tok"],
            norm_topk_prob=arch["norm_topk_prob"],
        )
        pattern = arch.get("moe_layer_pattern")
        if pattern:
            cfg["mlp_only_layers"] = [i for i, m in enumerate(pattern) if not m]
    return cfg


def _cases(root: Path) -> list[str]:
    manifest = json.loads((root / "manifest.json").read_text())
    return [c["name"] for c in manifest["cases"] if not any(s in c["name"] for s in SKIP)]


def _records(root: Path, case: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((root / case / f"rank{r}.json").read_text()) for r in range(world)]


def test_every_rank_holds_what_megatron_layout_predicts(megatron_ground_truth: Path) -> None:
    root = megatron_ground_truth
    checked = 0
    for case in _cases(root):
        recs = _records(root, case, 4)
        rec0 = recs[0]
        if rec0["error"]:
            continue
        arch, sizes = rec0["arch"], rec0["sizes"]
        model = model_from_hf_config(_hf_config(arch), mtp=bool(arch.get("mtp_layers")))
        vpp = sizes["vpp"] or 1
        dims = ParallelDims(
            dp=sizes["dp"],
            tp=sizes["tp"],
            pp=sizes["pp"],
            cp=sizes["cp"],
            ep=sizes["ep"],
            etp=sizes["etp"],
            vpp=vpp,
        )
        # stage lengths as Megatron placed the layers (checked against our default split below)
        lengths = [0] * (dims.pp * vpp)
        for rec in recs:
            for v, chunk in enumerate(rec["chunks"]):
                lengths[v * dims.pp + rec["ranks"]["pp"]] = len(chunk["layer_numbers"])
        stages = StagePlan(
            costs=(1.0,) * model.num_layers,
            num_stages=dims.pp,
            vpp=vpp,
            stage_lengths=tuple(lengths),
            allow_empty_ends=0 in (lengths[0], lengths[-1]),  # "...|mL": the MTP layer alone
        )
        if not rec0["config"]:
            assert megatron_layout(model, dims, vocab_divisible_by=1) == megatron_layout(
                model, dims, stages=stages, vocab_divisible_by=1
            ), case
        layout = megatron_layout(model, dims, stages=stages, vocab_divisible_by=1)
        for r, rec in enumerate(recs):
            real = {}
            for v, chunk in enumerate(rec["chunks"]):
                prefix = f"model{v}." if vpp > 1 else ""
                for name, shape, _dtype in chunk["parameters"] + chunk.get("buffers", []):
                    real[prefix + name] = tuple(shape)
            ours = {lt.name: lt.shape for lt in layout.local_tensors(r)}
            assert ours == real, (
                f"{case} rank {r}: ours-real {sorted(set(ours) - set(real))[:5]} real-ours {sorted(set(real) - set(ours))[:5]} shapes {[(n, ours[n], real[n]) for n in ours if n in real and ours[n] != real[n]][:5]}"
            )
            # experts: which global experts this rank holds
            for v, chunk in enumerate(rec["chunks"]):
                for module, experts in (chunk.get("experts") or {}).items():
                    local_layer = int(module.split(".")[2])
                    layer = sum(lengths[: v * dims.pp + rec["ranks"]["pp"]]) + local_layer
                    if module.startswith("mtp."):  # mtp.layers.{j}.transformer_layer.mlp
                        layer = model.num_layers + local_layer
                    prefix = f"model{v}." if vpp > 1 else ""
                    expert_of = re.compile(rf"^model\.layers\.{layer}\.\w+\.experts\.(\d+)\.")
                    stacked = re.compile(rf"^model\.layers\.{layer}\.mlp\.experts\.[a-z_]+$")
                    held = sorted(
                        {
                            _expert_of(expert_of, stacked, p.canonical, p.canonical_region)
                            for lt in layout.local_tensors(r)
                            if lt.name.startswith(f"{prefix}{module}.experts.")
                            for p in lt.pieces
                            if p.canonical is not None
                            and (expert_of.match(p.canonical) or stacked.match(p.canonical))
                        }
                    )
                    assert held == sorted(experts), (case, r, module)
            checked += 1
    assert checked >= 4 * 20, checked


def _expert_of(
    per_expert: "re.Pattern[str]", stacked: "re.Pattern[str]", name: str, box: Any
) -> int:
    """The global expert a piece holds: from a per-expert canonical name, or for a
    stacked tensor [E, ...] (gpt-oss) from the piece's first canonical dim."""
    m = per_expert.match(name)
    if m is not None:
        return int(m.group(1))
    assert stacked.match(name) and box.shape[0] == 1, (name, box)
    return int(box.ranges[0][0])


def test_our_meshes_give_megatron_parallel_state_groups(megatron_ground_truth: Path) -> None:
    """MegatronMeshes(dims).dense/.expert groups equal the groups parallel_state built."""
    from areal_fn.layouts.megatron import MegatronMeshes

    root = megatron_ground_truth
    axes = {
        "tp": ("dense", "tp"),
        "pp": ("dense", "pp"),
        "cp": ("dense", "cp"),
        "dp": ("dense", "dp"),
        "ep": ("expert", "ep"),
        "etp": ("expert", "etp"),
        "expert_dp": ("expert", "edp"),
    }
    checked = 0
    for case in _cases(root):
        recs = _records(root, case, 4)
        if recs[0]["error"]:
            continue
        sz = recs[0]["sizes"]
        dims = ParallelDims(
            dp=sz["dp"],
            tp=sz["tp"],
            pp=sz["pp"],
            cp=sz["cp"],
            ep=sz["ep"],
            etp=sz["etp"],
            vpp=sz["vpp"] or 1,
        )
        meshes = MegatronMeshes.of(dims)
        for r, rec in enumerate(recs):
            for key, (which, axis) in axes.items():
                if key not in rec["groups"]:
                    continue
                mesh = meshes.dense if which == "dense" else meshes.expert
                ours = list(mesh.group_of(r, axis))
                assert ours == rec["groups"][key], (case, r, key, ours, rec["groups"][key])
                checked += 1
    assert checked >= 100, checked
