"""Tiny models vLLM's CPU build serves (head_dim >= 32), written as HF model directories.

Each case is a config, a tensor-parallel degree and a seed; :func:`write_model` saves
random weights with transformers and a word-level tokenizer (built locally, one token
per id) so that vLLM's OpenAI server can answer ``/v1/completions``.
"""

from pathlib import Path
from typing import Any

import attrs

from areal_fn.model.spec import ModelSpec, model_from_hf_config

_BASE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}


@attrs.frozen(kw_only=True)
class Case:
    name: str
    config: dict[str, Any]
    tp: int
    #: also update the engine from an in-process trainer and compare its generation
    sync: bool = False

    @property
    def spec(self) -> ModelSpec:
        return model_from_hf_config(self.config)


def _cfg(model_type: str, arch: str, **kw: Any) -> dict[str, Any]:
    return {"model_type": model_type, "architectures": [arch], **_BASE, **kw}


#: vocabularies off a multiple of 64 (padding), KV heads fewer than tp (replication),
#: tied and untied heads, biases (qwen2) and q/k norms (qwen3)
CASES = {
    c.name: c
    for c in (
        Case(
            name="qwen2-t2",
            config=_cfg(
                "qwen2",
                "Qwen2ForCausalLM",
                num_key_value_heads=2,
                vocab_size=500,
                tie_word_embeddings=False,
            ),
            tp=2,
        ),
        Case(
            name="qwen3-kv1-tied-t2",
            config=_cfg(
                "qwen3",
                "Qwen3ForCausalLM",
                num_key_value_heads=1,
                head_dim=32,
                vocab_size=300,
                tie_word_embeddings=True,
            ),
            tp=2,
        ),
        Case(
            name="qwen3_moe-t2",
            config=_cfg(
                "qwen3_moe",
                "Qwen3MoeForCausalLM",
                num_key_value_heads=2,
                head_dim=32,
                vocab_size=300,
                tie_word_embeddings=False,
                moe_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=4,  # every expert: no routing ties to flip
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
            tp=2,
        ),
        Case(
            name="llama-t1",
            config=_cfg(
                "llama",
                "LlamaForCausalLM",
                num_key_value_heads=2,
                vocab_size=333,
                tie_word_embeddings=False,
            ),
            tp=1,
            sync=True,
        ),
    )
}


def write_model(path: Path, config: dict[str, Any], *, seed: int = 0) -> Path:
    """Random weights of ``config``, its config and a tokenizer in ``path`` (the main
    job's own writer)."""
    from areal_fn.runtime.demo.vllm_stage import write_served_model

    return write_served_model(path, config, seed=seed)
