"""Megatron-Core on CPU (gloo): what it builds under every strategy, and that it runs.

One ``torchrun --nproc-per-node 4`` launch (``megatron_worker.py``) builds tiny
GPTModels for several families under t2, p2, t2p2, p2v2, uneven pipelines, e2, e4,
t2e2 (etp 2 and 1), p2e2, and records every rank's parameters, state-dict keys,
sharded-state-dict entries and experts as JSON. The tests below check those records
against facts derived here from the architecture alone (never from areal_fn's own
layout code), and check the forward passes against Hugging Face ``transformers``.

Later tests use the records as ground truth: depend on the ``megatron_ground_truth``
fixture (``tests/distributed/conftest.py``) and read ``<dir>/<case>/rank<r>.json`` and
``<dir>/manifest.json``.
"""

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs megatron-core and transformers", allow_module_level=True)

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("megatron_cpu")]

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
# Observed: 0 without tensor parallelism, <= 7.2e-7 with it (fp32, |logits| ~ 1.5).
LOGITS_ATOL = 1e-5


# ------------------------------------------------------------------ helpers


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def _records(root: Path, case: str) -> list[dict[str, Any]]:
    return [json.loads((root / case / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _cases(
    root: Path, *, mode: str | None = "forward"
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for case in _manifest(root)["cases"]:
        if mode is None or case["mode"] == mode:
            yield case["name"], _records(root, case["name"])


def _params(chunk: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for name, shape, _ in chunk["parameters"]}


def _stage_layers(rec: dict[str, Any]) -> list[tuple[int, int]]:
    """(pipeline stage index in model order, global layer) for each local layer."""
    pp, pp_rank = rec["sizes"]["pp"], rec["ranks"]["pp"]
    out = []
    for v, chunk in enumerate(rec["chunks"]):
        out += [(v * pp + pp_rank, n - 1) for n in chunk["layer_numbers"]]
    return out


def _expected_layer_params(
    arch: dict[str, Any], sizes: dict[str, Any], moe_layer: bool
) -> dict[str, tuple[int, ...]]:
    """Megatron-Core 0.16 local-spec parameter names/shapes of one decoder layer."""
    h = arch["hidden_size"]
    d = arch["head_dim"] or h // arch["num_attention_heads"]
    nh, kv = arch["num_attention_heads"], arch["num_key_value_heads"]
    tp, etp = sizes["tp"], sizes["etp"]
    qkv_rows = (nh + 2 * kv) * d // tp
    out: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_proj.weight": (h, nh * d // tp),
        "pre_mlp_layernorm.weight": (h,),
    }
    if arch.get("kv_lora_rank"):  # multi-latent attention: every projection column-parallel
        del out["self_attention.linear_qkv.weight"]
        ql, kvl, rope, v = (
            arch[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
        )
        a = "self_attention."
        if ql:
            out[a + "linear_q_down_proj.weight"] = (ql // tp, h)
            out[a + "q_layernorm.weight"] = (ql,)
            out[a + "linear_q_up_proj.weight"] = (nh * d // tp, ql)
        else:
            out[a + "linear_q_proj.weight"] = (nh * d // tp, h)
        out[a + "linear_kv_down_proj.weight"] = ((kvl + rope) // tp, h)
        out[a + "kv_layernorm.weight"] = (kvl,)
        out[a + "linear_kv_up_proj.weight"] = (nh * (d - rope + v) // tp, kvl)
        out[a + "linear_proj.weight"] = (h, nh * v // tp)
    if arch["qkv_bias"]:
        out["self_attention.linear_qkv.bias"] = (qkv_rows,)
    if arch["qk_norm"]:
        out["self_attention.q_layernorm.weight"] = (d,)
        out["self_attention.k_layernorm.weight"] = (d,)
    if moe_layer:
        e, mi = arch["num_experts"], arch["moe_intermediate_size"]
        out["mlp.router.weight"] = (e, h)
        shared = arch.get("num_shared_experts") or 0
        if shared:
            out["mlp.shared_experts.linear_fc1.weight"] = (2 * shared * mi // tp, h)
            out["mlp.shared_experts.linear_fc2.weight"] = (h, shared * mi // tp)
        for i in range(e // sizes["ep"]):
            out[f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = (2 * mi // etp, h)
            out[f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = (h, mi // etp)
    else:
        inter = arch["intermediate_size"]
        out["mlp.linear_fc1.weight"] = (2 * inter // tp, h)
        out["mlp.linear_fc2.weight"] = (h, inter // tp)
    if arch.get("mlp_bias") and arch.get("o_bias"):  # add_bias_linear (gpt-oss)
        out["self_attention.linear_proj.bias"] = (h,)
        if moe_layer:
            out["mlp.router.bias"] = (arch["num_experts"],)
            for i in range(arch["num_experts"] // sizes["ep"]):
                mi = arch["moe_intermediate_size"]
                out[f"mlp.experts.local_experts.{i}.linear_fc1.bias"] = (2 * mi // etp,)
                out[f"mlp.experts.local_experts.{i}.linear_fc2.bias"] = (h,)
    if arch.get("attention_sinks"):  # softmax_type="learnable": one logit per local head
        out["self_attention.core_attention.softmax_offset"] = (nh // tp,)
    return out


def _is_moe_layer(arch: dict[str, Any], layer: int) -> bool:
    if not arch["num_experts"]:
        return False
    pattern = arch["moe_layer_pattern"]
    return pattern is None or bool(pattern[layer])


# -------------------------------------------------------------------- tests


def test_every_case_recorded_by_every_rank(megatron_ground_truth: Path) -> None:
    manifest = _manifest(megatron_ground_truth)
    assert manifest["world_size"] == WORLD
    assert manifest["megatron_core"].startswith("0.16.")
    names = [c["name"] for c in manifest["cases"]]
    for required in ("t2", "p2", "t2p2", "p2v2"):
        assert any(n.endswith(f"-{required}") for n in names), required
    for required in ("qwen3_moe-e2", "qwen3_moe-t2e2"):
        assert required in names
    for name in names:
        assert sorted(p.name for p in (megatron_ground_truth / name).iterdir()) == [
            f"rank{r}.json" for r in range(WORLD)
        ]


def test_ranks_follow_megatron_order_tp_cp_ep_dp_pp(megatron_ground_truth: Path) -> None:
    # Dense grid: rank = tp_r + tp*(cp_r + cp*(dp_r + dp*pp_r)); expert grid:
    # rank = etp_r + etp*(ep_r + ep*(edp_r + edp*pp_r)). Groups vary one coordinate.
    for name, recs in _cases(megatron_ground_truth, mode=None):
        s = recs[0]["sizes"]
        tp, cp, dp, pp, ep, etp = s["tp"], s["cp"], s["dp"], s["pp"], s["ep"], s["etp"]
        edp = WORLD // (etp * ep * pp)
        for rank, rec in enumerate(recs):
            r = rec["ranks"]
            assert rank == r["tp"] + tp * (r["cp"] + cp * (r["dp"] + dp * r["pp"])), name
            assert rank == r["etp"] + etp * (r["ep"] + ep * (r["expert_dp"] + edp * r["pp"])), name
            g = rec["groups"]
            assert g["tp"] == [rank - r["tp"] + i for i in range(tp)], name
            assert g["pp"] == [rank + (i - r["pp"]) * tp * cp * dp for i in range(pp)], name
            assert g["dp"] == [rank + (i - r["dp"]) * tp * cp for i in range(dp)], name
            assert g["etp"] == [rank - r["etp"] + i for i in range(etp)], name
            assert g["ep"] == [rank + (i - r["ep"]) * etp for i in range(ep)], name
            assert g["expert_dp"] == [rank + (i - r["expert_dp"]) * etp * ep for i in range(edp)], (
                name
            )
            # The embedding group joins the first and last pipeline stages.
            assert g["embedding"] == ([g["pp"][0], g["pp"][-1]] if pp > 1 else [rank]), name


def test_pipeline_stages_hold_each_layer_once(megatron_ground_truth: Path) -> None:
    expected_counts = {  # layers per (virtual) stage in model order, where not even
        "qwen2-p2-first1": [1, 3],
        "qwen2-p2-layout": [1, 3],
        "llama_tied-p2v2-layout": [1, 1, 1, 1],
        "glm4_moe_mtp-p2v2-layout": [2, 1, 1, 0],  # "Ett|t|t|mL": the MTP layer alone
    }
    for name, recs in _cases(megatron_ground_truth, mode=None):
        if recs[0]["mode"] == "expect_error":
            continue
        s = recs[0]["sizes"]
        stages = s["pp"] * (s["vpp"] or 1)
        layers = recs[0]["arch"]["num_layers"]
        by_stage: dict[int, list[int]] = {}
        for rec in recs:
            if rec["ranks"]["tp"] or rec["ranks"]["dp"] or rec["ranks"]["cp"]:  # one replica
                continue
            for v in range(len(rec["chunks"])):  # a chunk may hold no decoder layer
                by_stage.setdefault(v * s["pp"] + rec["ranks"]["pp"], [])
            for stage, layer in _stage_layers(rec):
                by_stage[stage].append(layer)
            for chunk in rec["chunks"]:
                n = len(chunk["layer_numbers"])
                # names use local indices 0..n-1; layer_number is global and 1-based
                assert chunk["layer_numbers"] == list(
                    range(chunk["layer_offset"] + 1, chunk["layer_offset"] + n + 1)
                )
                local = {
                    int(p.split(".")[2])
                    for p, _, _ in chunk["parameters"]
                    if p.startswith("decoder.layers.")
                }
                assert local == set(range(n)), name
        assert sorted(by_stage) == list(range(stages)), name
        flat = [layer for stage in sorted(by_stage) for layer in by_stage[stage]]
        assert flat == list(range(layers)), name
        counts = [len(by_stage[i]) for i in sorted(by_stage)]
        assert counts == expected_counts.get(name, [layers // stages] * stages), name


def test_parameter_names_and_shapes(megatron_ground_truth: Path) -> None:
    for name, recs in _cases(megatron_ground_truth, mode="forward"):
        for rec in recs:
            arch, s = rec["arch"], rec["sizes"]
            h, v, tp = arch["hidden_size"], arch["vocab_size"], s["tp"]
            for chunk in rec["chunks"]:
                expected: dict[str, tuple[int, ...]] = {}
                if chunk["pre_process"]:
                    expected["embedding.word_embeddings.weight"] = (v // tp, h)
                for i, number in enumerate(chunk["layer_numbers"]):
                    layer = _expected_layer_params(arch, s, _is_moe_layer(arch, number - 1))
                    expected |= {f"decoder.layers.{i}.{k}": shape for k, shape in layer.items()}
                if chunk["post_process"]:
                    expected["decoder.final_layernorm.weight"] = (h,)
                    # tied + single stage: the output layer reuses the embedding parameter
                    if not (arch["tie_word_embeddings"] and chunk["pre_process"]):
                        expected["output_layer.weight"] = (v // tp, h)
                assert _params(chunk) == expected, (name, rec["rank"], chunk["vp_stage"])
                # state_dict = parameters + one `_extra_state` per parallel linear layer
                # (+ the router's expert bias buffer where routing has one)
                extra = [k for k in chunk["state_dict_keys"] if k not in expected]
                bias = "mlp.router.expert_bias"
                assert all(k.endswith(("._extra_state", bias)) for k in extra), (name, extra)
                assert any(k.endswith(bias) for k in extra) == bool(
                    arch.get("router_bias")
                    and any(_is_moe_layer(arch, n - 1) for n in chunk["layer_numbers"])
                ), name
                if arch["tie_word_embeddings"] and chunk["pre_process"] and chunk["post_process"]:
                    assert "output_layer.weight" not in chunk["state_dict_keys"]


def test_dp_replicas_have_identical_structure(megatron_ground_truth: Path) -> None:
    for name, recs in _cases(megatron_ground_truth, mode=None):
        if recs[0]["mode"] == "expect_error":
            continue
        seen: dict[tuple[int, ...], Any] = {}
        for rec in recs:
            r = rec["ranks"]
            key = (r["tp"], r["pp"], r["ep"], r["etp"])
            structure = [
                (c["parameters"], c["state_dict_keys"], c["experts"]) for c in rec["chunks"]
            ]
            assert seen.setdefault(key, structure) == structure, (name, key)


def test_experts_are_split_evenly_over_ep(megatron_ground_truth: Path) -> None:
    moe_cases = [
        (n, r) for n, r in _cases(megatron_ground_truth, mode=None) if r[0]["arch"]["num_experts"]
    ]
    assert moe_cases
    for name, recs in moe_cases:
        if recs[0]["mode"] == "expect_error":
            continue
        arch, s = recs[0]["arch"], recs[0]["sizes"]
        e, ep = arch["num_experts"], s["ep"]
        for rec in recs:
            r = rec["ranks"]
            for chunk in rec["chunks"]:
                moe_layers = [n - 1 for n in chunk["layer_numbers"] if _is_moe_layer(arch, n - 1)]
                decoder = [k for k in chunk["experts"] if k.startswith("decoder.")]
                assert len(decoder) == len(moe_layers), name
                # the MTP block's layers (routed experts) on the last chunk of the last stage
                mtp = [k for k in chunk["experts"] if k.startswith("mtp.")]
                assert len(mtp) == (arch.get("mtp_layers") or 0) * chunk["post_process"], name
                for held in chunk["experts"].values():
                    assert held == [r["ep"] * (e // ep) + i for i in range(e // ep)], name
        # the ep group together holds every expert exactly once
        for rec in recs:
            group = [recs[q] for q in rec["groups"]["ep"]]
            for key in rec["chunks"][0]["experts"]:
                union = sorted(x for g in group for x in g["chunks"][0]["experts"][key])
                assert union == list(range(e)), (name, key)


def test_what_the_local_spec_refuses_on_cpu(megatron_ground_truth: Path) -> None:
    errors = {
        name: {r["error"] for r in recs}
        for name, recs in _cases(megatron_ground_truth, mode="expect_error")
    }
    assert set(errors) == {"qwen3_moe-e2-grouped"}
    (grouped,) = errors["qwen3_moe-e2-grouped"]
    assert grouped.startswith("AssertionError: Grouped GEMM is not available")


def test_the_local_spec_refuses_context_parallelism_without_our_core_attention() -> None:
    # why build.layer_spec replaces the core attention under cp > 1 (no process needed)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from areal_fn.runtime.megatron.build import MegatronSizes, transformer_config
    from tests.distributed.megatron_worker import FAMILIES

    config = transformer_config(FAMILIES["qwen2"], MegatronSizes(cp=2))
    with pytest.raises(AssertionError, match=r"^Context parallelism is only supported by TEDot"):
        DotProductAttention(config, 1, AttnMaskType.causal, "self")


def test_legacy_grouped_mlp_structure(megatron_ground_truth: Path) -> None:
    # Kernel check bypassed (structure only): GroupedMLP holds two fused tensors per layer.
    ((name, recs),) = _cases(megatron_ground_truth, mode="grouped_structure")
    for rec in recs:
        arch, s = rec["arch"], rec["sizes"]
        h, mi = arch["hidden_size"], arch["moe_intermediate_size"]
        local = arch["num_experts"] // s["ep"]
        params = _params(rec["chunks"][0])
        assert params["decoder.layers.0.mlp.experts.weight1"] == (h, 2 * mi * local // s["etp"])
        assert params["decoder.layers.0.mlp.experts.weight2"] == (mi * local // s["etp"], h)
        assert not any("local_experts" in p for p in params), name


def test_forward_matches_transformers(megatron_ground_truth: Path) -> None:
    batch, seq = 2, 8
    for name, recs in _cases(megatron_ground_truth, mode="forward"):
        for rec in recs:
            fw = rec["forward"]
            last_stage = rec["chunks"][-1]["post_process"]
            for run in ("random_init", "hf"):
                if not last_stage:
                    assert fw[run]["logits_shape"] is None, name
                    continue
                assert fw[run]["logits_shape"] == [batch, seq, rec["arch"]["vocab_size"]], name
                assert fw[run]["finite"], name
            if last_stage:
                assert fw["hf"]["max_abs_diff"] <= LOGITS_ATOL, (name, fw["hf"])
                assert fw["random_init"]["max_abs_diff_to_hf"] > 100 * LOGITS_ATOL, name


def test_training_step_runs_and_matches_transformers_loss(megatron_ground_truth: Path) -> None:
    for name, recs in _cases(megatron_ground_truth, mode="forward"):
        arch, s = recs[0]["arch"], recs[0]["sizes"]
        for rec in recs:
            train = rec["forward"]["train"]
            if arch["num_experts"] and s["tp"] > 1:
                # MoELayer refuses training-mode TP without sequence parallelism, and the
                # local spec's torch RMSNorm refuses sequence parallelism.
                assert train["error"].startswith("ValueError: During training"), name
                continue
            assert train["error"] is None, name
            assert train["with_grad"] == train["parameters"] > 0, name
            assert train["grads_finite"], name
            if rec["chunks"][-1]["post_process"]:
                assert len(train["losses"]) == 2, name  # one per micro-batch
                for got, want in zip(train["losses"], train["hf_losses"], strict=True):
                    assert abs(got - want) <= LOGITS_ATOL, (name, got, want)
            else:
                assert train["losses"] == [], name


def test_tied_embeddings_are_synchronised_across_stages(megatron_ground_truth: Path) -> None:
    checked = 0
    for name, recs in _cases(megatron_ground_truth, mode="forward"):
        if not recs[0]["arch"]["tie_word_embeddings"] or recs[0]["sizes"]["pp"] == 1:
            continue
        for rec in recs:
            first, last = rec["groups"]["embedding"]
            a = recs[first]["chunks"][0]["shared_embedding_sum"]
            b = recs[last]["chunks"][-1]["shared_embedding_sum"]
            assert a is not None and a == b, name
            checked += 1
    assert checked


def _sharded_key_rest(rest: str, *, mla: bool = False) -> str:
    """Checkpoint name of a layer-local parameter name (local spec -> TE-style keys;
    a multi-latent attention layer maps no key: both its norms keep their names)."""
    renamed = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    if mla:
        renamed = {}
    if rest.startswith("mlp.experts.local_experts."):
        # mlp.experts.local_experts.<i>.linear_fc1.weight -> mlp.experts.experts.linear_fc1.weight
        return "mlp.experts.experts." + rest.split(".", 4)[4]
    return renamed.get(rest, rest)


def test_sharded_state_dict_keys_and_offsets(megatron_ground_truth: Path) -> None:
    for name, recs in _cases(megatron_ground_truth, mode="forward"):
        for rec in recs:
            arch, s, r = rec["arch"], rec["sizes"], rec["ranks"]
            layers = arch["num_layers"]
            # moe_layer_freq given as a list => one key per layer (global index in the
            # key); otherwise all layers share a key with a prepended global layer axis.
            per_layer_keys = arch["moe_layer_pattern"] is not None
            for chunk in rec["chunks"]:
                for entry in chunk["sharded"]:
                    local = entry["local_key"]
                    if not local.startswith("decoder.layers.") or entry.get("object"):
                        continue
                    base, _, piece = local.partition("/")
                    parts = base.split(".")
                    g = chunk["layer_offset"] + int(parts[2])
                    rest = ".".join(parts[3:])
                    if per_layer_keys:
                        assert (
                            entry["key"]
                            == f"decoder.layers.{g}.{_sharded_key_rest(rest, mla=bool(arch.get('kv_lora_rank')))}"
                        ), (
                            name,
                            entry,
                        )
                        axis = 0
                    else:
                        assert (
                            entry["key"]
                            == f"decoder.layers.{_sharded_key_rest(rest, mla=bool(arch.get('kv_lora_rank')))}"
                        ), (
                            name,
                            entry,
                        )
                        assert entry["global_shape"][0] == layers, (name, entry)
                        assert entry["global_offset"][0] == g, (name, entry)
                        axis = 1
                    if rest.startswith("mlp.experts.local_experts."):
                        e, ep = arch["num_experts"], s["ep"]
                        expert = r["ep"] * (e // ep) + int(parts[6])
                        assert entry["global_shape"][axis] == e, (name, entry)
                        assert entry["global_offset"][axis] == expert, (name, entry)
                        axis += 1
                    if rest.endswith("linear_fc1.weight"):
                        # [gate; up] of the whole layer, each TP/ETP rank's rows at two places
                        moe = rest.startswith("mlp.experts.")
                        width = arch["moe_intermediate_size" if moe else "intermediate_size"]
                        if rest.startswith("mlp.shared_experts."):  # dense TP, fused width
                            width = arch["num_shared_experts"] * arch["moe_intermediate_size"]
                        parallel, prank = (s["etp"], r["etp"]) if moe else (s["tp"], r["tp"])
                        assert entry["global_shape"][axis] == 2 * width, (name, entry)
                        rows = width // parallel
                        assert entry["global_offset"][axis] == int(piece) * width + prank * rows, (
                            name,
                            entry,
                        )


def test_redirections_are_opt_in_idempotent_and_reversible() -> None:
    import torch

    from areal_fn.runtime.megatron import cpu as megatron_cpu

    assert not megatron_cpu.is_enabled()
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    originals = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        mcore_random.CudaRNGStatesTracker.fork,
        schedules.torch,
        mcore_random._get_cuda_rng_state,
        mcore_random._set_cuda_rng_state,
    )
    had_gemm = "te_general_gemm" in vars(moe_utils)
    with megatron_cpu.cpu_megatron():
        assert megatron_cpu.is_enabled()
        assert torch.cuda.current_device() == torch.device("cpu")
        patched = torch.cuda.current_device
        megatron_cpu.enable()  # idempotent
        assert torch.cuda.current_device is patched
        with megatron_cpu.cpu_megatron():  # nested: leaves the outer one on
            pass
        assert megatron_cpu.is_enabled()
        assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
        assert moe_utils.te_general_gemm is None or had_gemm
        # activation recompute saves and restores "the CUDA RNG state": none on the CPU
        assert mcore_random._get_cuda_rng_state().numel() == 0
        mcore_random._set_cuda_rng_state(torch.empty(0, dtype=torch.uint8))
        tracker = mcore_random.CudaRNGStatesTracker()
        tracker.add("a", 1)
        outside = torch.get_rng_state()
        with tracker.fork("a"):
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outside)  # the outer stream is untouched
        tracker2 = mcore_random.CudaRNGStatesTracker()
        tracker2.add("a", 1)
        with tracker2.fork("a"):
            assert torch.equal(torch.rand(3), first)  # same seed, same stream
    assert not megatron_cpu.is_enabled()
    assert (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        mcore_random.CudaRNGStatesTracker.fork,
        schedules.torch,
        mcore_random._get_cuda_rng_state,
        mcore_random._set_cuda_rng_state,
    ) == originals
    assert ("te_general_gemm" in vars(moe_utils)) == had_gemm
    assert "cuda" not in vars(torch.Tensor)
    megatron_cpu.disable()  # idempotent too


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda S: S(tp=0), r"^tp=0 must be >= 1$"),
        (lambda S: S(etp=0), r"^etp=0 must be >= 1 or None$"),
        (lambda S: S(vpp=2), r"^vpp=2 needs pp > 1 \(pp=1\); set pp or drop vpp$"),
        (
            lambda S: S(order="tp-dp-pp"),
            r"^order='tp-dp-pp' must be a permutation of 'tp-cp-ep-dp-pp'$",
        ),
        (
            lambda S: S(tp=4).dp(6),
            r"^world_size=6 is not divisible by tp\*pp\*cp=4\*1\*1=4; use a world size that"
            r" is a multiple of 4$",
        ),
        (
            lambda S: S(tp=2, ep=4).dp(4),
            r"^world_size=4 is not divisible by etp\*ep\*pp=2\*4\*1=8; use a world size that"
            r" is a multiple of 8$",
        ),
    ],
)
def test_megatron_sizes_errors(call: Any, message: str) -> None:
    from areal_fn import LayoutError
    from areal_fn.runtime.megatron.build import MegatronSizes

    with pytest.raises(LayoutError, match=message):
        call(MegatronSizes)


def test_megatron_sizes_defaults() -> None:
    from areal_fn.runtime.megatron.build import MegatronSizes

    sizes = MegatronSizes(tp=2, pp=2, vpp=1)
    assert (sizes.vpp, sizes.expert_tp, sizes.dp(8)) == (None, 2, 2)
    assert MegatronSizes(tp=2, etp=1, ep=4).expert_tp == 1


def test_run_torchrun_reports_each_rank_and_kills_on_timeout(tmp_path: Path) -> None:
    from areal_fn.runtime.launch import LaunchError

    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "rank = os.environ['RANK']\n"
        "print('out', rank, flush=True); print('err', rank, file=sys.stderr, flush=True)\n"
        f"done = pathlib.Path({str(tmp_path / 'rank0-printed')!r})\n"
        "if rank == '0': done.touch()\n"
        "if sys.argv[1] == 'sleep': time.sleep(120)\n"
        "# rank 1 fails only once rank 0 has printed (torchrun then stops rank 0)\n"
        "deadline = time.monotonic() + 50\n"
        "while rank == '1' and not done.exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "if rank == '1': sys.exit(3)\n"
    )
    with pytest.raises(LaunchError) as caught:
        run_torchrun(script, ["fail"], nproc=2, timeout_s=60)
    result = caught.value.result
    assert not result.ok and not result.timed_out and result.returncode != 0
    assert [s.strip() for s in result.rank_stdout] == ["out 0", "out 1"]
    assert [s.strip() for s in result.rank_stderr] == ["err 0", "err 1"]
    assert "--- rank 1 stderr (tail) ---\nerr 1" in str(caught.value)

    start = time.monotonic()
    slow = run_torchrun(script, ["sleep"], nproc=2, timeout_s=5, check=False)
    assert slow.timed_out and not slow.ok
    assert time.monotonic() - start < 60
