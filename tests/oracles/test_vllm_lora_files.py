"""What ``VllmLoraSync`` checks and counts without a vLLM (the engine is in tests/vllm).

- ``safetensors_payload_bytes`` equals the tensor bytes safetensors itself lists;
- the refusals before anything is written or sent, each message pinned: not an offline
  ``vllm.LLM``, a bad adapter name or id, a vLLM without LoRA, a rank over its
  ``max_lora_rank``. vLLM's own ``LLM`` is not importable here: a stand-in of its type
  name carries the one field read (``llm_engine.vllm_config.lora_config``).
"""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from areal_fn.errors import ConversionError, PlanError
from areal_fn.model.lora import LoraConfig, LoraError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.vllm.lora import VllmLoraSync, safetensors_payload_bytes

SPEC = model_from_hf_config(
    {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
    }
)


def test_payload_bytes_are_what_safetensors_lists(tmp_path: Path) -> None:
    file = tmp_path / "a.safetensors"
    tensors = {
        "a": torch.zeros(3, 5),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "c": torch.zeros(2, 2, 2, dtype=torch.int64),
    }
    save_file(tensors, str(file), metadata={"format": "pt"})
    with safe_open(str(file), "pt") as f:
        listed = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert safetensors_payload_bytes(file) == listed == 60 + 14 + 64


class LLM:  # the type name VllmLoraSync asks for
    def __init__(self, lora: Any) -> None:
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(lora_config=lora))


def test_refusals_before_anything_moves(tmp_path: Path) -> None:
    config = LoraConfig(rank=8, module_ranks={"down_proj": 16})
    lora8 = SimpleNamespace(max_lora_rank=8)
    with pytest.raises(PlanError, match=r"takes an offline vllm.LLM started with enable_lora"):
        VllmLoraSync("http://127.0.0.1:8000", tmp_path, SPEC, config)
    with pytest.raises(PlanError, match=r"adapter name='a/b' must be a plain directory name"):
        VllmLoraSync(LLM(lora8), tmp_path, SPEC, config, name="a/b")
    with pytest.raises(PlanError, match=r"lora_id=0 must be an int >= 1 \(vLLM's adapter id\)"):
        VllmLoraSync(LLM(lora8), tmp_path, SPEC, config, lora_id=0)
    with pytest.raises(PlanError, match=r"this vLLM was started without LoRA; start it with"):
        VllmLoraSync(LLM(None), tmp_path, SPEC, config)
    with pytest.raises(
        LoraError, match=r"adapter ranks \{'down_proj': 16\} exceed this vLLM's max_lora_rank=8"
    ):
        VllmLoraSync(LLM(lora8), tmp_path, SPEC, config)
    assert list(tmp_path.iterdir()) == []
    sync = VllmLoraSync(LLM(SimpleNamespace(max_lora_rank=16)), tmp_path, SPEC, config)
    with pytest.raises(PlanError, match=r"no adapter version is loaded yet: call update"):
        _ = sync.lora_request
    with pytest.raises(PlanError, match=r"version=-1 must be a non-negative int"):
        sync.update(-1, {})
    with pytest.raises(ConversionError, match=r"missing"):
        sync.update(1, {})
    sync.version = 3  # as after serving version 3
    with pytest.raises(PlanError, match=r"version=3 is not newer than the served version 3; "):
        sync.update(3, {})
    assert sorted(p.name for p in tmp_path.rglob("*")) == []
    # float32 elements r * (in + out) per target; per layer q, k, v, o, gate, up, down
    per_layer = [(8, 32, 32), (8, 32, 16), (8, 32, 16), (8, 32, 32), (8, 32, 48), (8, 32, 48)]
    per_layer.append((16, 48, 32))
    assert sync.lower_bound == 4 * 2 * sum(r * (i + o) for r, i, o in per_layer) == 34816
