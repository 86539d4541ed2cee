"""The cost models count DeepSeek sparse attention: the indexer's key cache, its
scoring FLOPs, the top-k attention pairs, and no indexer on a layer that reuses
another's top-k. Expected values are worked from the published configs' numbers."""

import subprocess
import sys
from pathlib import Path

from areal_fn import model_from_hf_config
from areal_fn.pipeline.costs import flop_costs, param_costs
from areal_fn.plans.memory.kv_cache import kv_cache

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
REPO = SPECS.parents[1]


def test_kv_cache_holds_the_indexer_key() -> None:
    """GLM-5 under vLLM TP8, 32768 tokens: 78 layers x (latent 512 + rope 64 + indexer
    key 128) bf16 elements per token."""
    spec = model_from_hf_config(SPECS / "GLM-5.json")
    cache = kv_cache(spec, "vllm:t8", context_len=32768)
    assert cache.max_bytes == 78 * 32768 * (512 + 64 + 128) * 2
    v3 = model_from_hf_config(SPECS / "DeepSeek-V3.json")
    assert kv_cache(v3, "vllm:t8", context_len=32768).max_bytes == 61 * 32768 * 576 * 2


def _tiny(**kw: object) -> dict[str, object]:
    return {
        "model_type": "glm_moe_dsa",
        "hidden_size": 16,
        "intermediate_size": 24,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 8,
        "q_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 4,
        "vocab_size": 32,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk": 4,
        "indexer_types": ["full", "shared", "full", "shared"],
        **kw,
    }


def test_shared_layers_hold_and_cache_no_indexer() -> None:
    spec = model_from_hf_config(_tiny())
    # wq_b 16 x 8, wk 8 x 16, k_norm 8 + 8, weights_proj 2 x 16
    indexer = 16 * 8 + 8 * 16 + 8 + 8 + 2 * 16
    layers = param_costs(spec).layers
    assert layers[0] - layers[1] == indexer == layers[2] - layers[3]
    cache = kv_cache(spec, "vllm:t1", context_len=10)
    assert cache.max_bytes == 10 * (4 * (8 + 4) + 2 * 8) * 2  # bf16


def test_flops_count_top_k_pairs_and_the_indexer() -> None:
    """DeepSeek-V3.2-Exp against DeepSeek-V3 (the same layer otherwise) at 4096 tokens:
    the attention keeps 2048 keys per query from the 2048th on, the indexer scores every
    causal pair with 64 heads of 128, and its projections add their weights."""
    seq, top = 4096, 2048
    pairs = seq * (seq + 1) // 2
    kept = top * (top + 1) // 2 + (seq - top) * top
    q, v = 128 * 192, 128 * 128
    attention = 2 * (q + v) * (kept - pairs)
    scoring = 2 * 64 * (128 + 1) * pairs
    projections = 2 * seq * (64 * 128 * 1536 + 128 * 7168 + 64 * 7168)
    v32 = flop_costs(model_from_hf_config(SPECS / "DeepSeek-V3.2-Exp.json"), seq_len=seq)
    v3 = flop_costs(model_from_hf_config(SPECS / "DeepSeek-V3.json"), seq_len=seq)
    for a, b in zip(v32.layers, v3.layers, strict=True):
        assert a - b == 3 * (attention + scoring + projections)


def test_plan_prints_the_published_configs() -> None:
    """``areal-fn plan`` on both published configs: the cache with the indexer's key
    (GLM-5: 3.4 GiB per rank at 32768 tokens) and the FSDP2 state."""
    for name, cache in (("GLM-5", "3.4 GiB"), ("DeepSeek-V3.2-Exp", "2.6 GiB")):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "areal_fn.cli",
                "plan",
                str(SPECS / f"{name}.json"),
                "vllm:t8+fsdp:d64t4",
                "--context-len",
                "32768",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            timeout=300,
        ).stdout
        assert "kv cache" in out and cache in out, out[:2000]
        assert "MemoryReport fsdp2, 256 ranks" in out
