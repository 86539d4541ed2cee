"""``plan``'s KV cache keeps ``min(context_len, sliding_window)`` tokens on a
sliding-window layer: computed here from each published config as transformers reads it
(its ``layer_types`` and ``sliding_window``), not from our spec."""

import json
from pathlib import Path

import pytest
import transformers

from areal_fn.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _expected(name: str, context_len: int, tp: int) -> int:
    """Bytes a rank of ``sglang:t{tp}`` caches for one sequence (bf16, one stage)."""
    raw = json.loads((ROOT / "specs" / "models" / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(**raw)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_local = max(1, config.num_key_value_heads // tp)
    per_token_layer = 2 * kv_local * head_dim * 2  # keys and values, bf16
    kinds = list(config.layer_types)
    assert len(kinds) == config.num_hidden_layers and "sliding_attention" in kinds
    tokens = sum(
        min(context_len, config.sliding_window) if kind == "sliding_attention" else context_len
        for kind in kinds
    )
    return tokens * per_token_layer


@pytest.mark.parametrize("name", ["gpt-oss-20b", "Olmo-3-1025-7B", "gemma-3-1b-it"])
@pytest.mark.parametrize("context_len", [64, 32768])
def test_sliding_layers_cache_their_window_only(
    name: str, context_len: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", name, "sglang:t2", "--context-len", str(context_len), "--json"]
    assert main(argv) == 0
    kv = json.loads(capsys.readouterr().out)["components"][0]["kv_cache"]
    assert kv["max_bytes"] == _expected(name, context_len, 2)
    assert kv["sliding_window"] > 0 and sum(kv["stage_sliding_layers"]) > 0


def test_a_model_without_sliding_layers_caches_every_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "Qwen3-8B", "sglang:t2", "--context-len", "1000", "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["components"][0]["kv_cache"]
    # 36 layers x 1000 tokens x 2 x (8 KV heads / 2) x 128 dims x 2 bytes
    assert kv["max_bytes"] == 36 * 1000 * 2 * 4 * 128 * 2
    assert kv["sliding_window"] == 0 and kv["stage_sliding_layers"] == [0]
