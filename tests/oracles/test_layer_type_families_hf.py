"""OLMo 3 and Gemma 3 text end to end through real transformers models and files.

A tiny model of each is saved by ``save_pretrained`` (transformers 5 writes its rope
nested by layer type); the spec read from that directory equals the spec of the config
it was built from; its tensors are read from the files into FSDP2 and inference
layouts (``to_megatron`` per rank), gathered back (``to_hf``), exported with
``write_hf_checkpoint`` (config: ``ModelSpec.hf_config()``) and loaded by
``from_pretrained``: the same tensors, bitwise, and the same logits.
"""

import json

import pytest
import torch

from areal_fn import fsdp2_layout, inference_layout, model_from_hf_config
from areal_fn.model.hf_memory import hf_state_to_canonical
from areal_fn.plans.convert import to_hf, to_megatron
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint

transformers = pytest.importorskip("transformers")

CONFIGS: dict[str, dict[str, object]] = {
    # a window of 3 on layers 0-2, YaRN on layer 3, one rope base other than the default
    "olmo3": {
        "model_type": "olmo3",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 90,
        "sliding_window": 3,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "max_position_embeddings": 128,
        "torch_dtype": "float32",
    },
    # tied, scaled embedding; linear rope scaling on the global layer only
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 90,
        "sliding_window": 3,
        "sliding_window_pattern": 3,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 100.0,
        "query_pre_attn_scalar": 12,
        "torch_dtype": "float32",
    },
}

#: Layouts read from the files: FSDP2 (gemma3_text also under TP) and inference TP2.
LAYOUTS = {"olmo3": ("fsdp:d2", "sglang:t2"), "gemma3_text": ("fsdp:d2t2", "vllm:t2")}


def _real_model(name: str) -> torch.nn.Module:
    cfg = dict(CONFIGS[name])
    config = transformers.AutoConfig.for_model(str(cfg.pop("model_type")), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # (1 + w) norms start at w = 0: give every tensor values
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_files_to_layouts_and_back_to_a_loadable_checkpoint(tmp_path, name: str) -> None:
    model = _real_model(name)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert set(saved["rope_parameters"]) == {"full_attention", "sliding_attention"}
    spec = model_from_hf_config(tmp_path / "hf")
    assert spec == model_from_hf_config(CONFIGS[name])
    ref = model.state_dict()
    canon = hf_state_to_canonical(ref, spec)
    with HfCheckpoint(tmp_path / "hf") as ckpt:
        ckpt.check(spec)
        for text in LAYOUTS[name]:
            make = fsdp2_layout if text.startswith("fsdp") else inference_layout
            layout = make(spec, text)
            states = {r: to_megatron(ckpt.read, layout, r) for r in range(layout.world_size)}
            back = to_hf(states, layout, check_replicas=True)
            assert back.keys() == canon.keys()
            assert all(torch.equal(back[k], canon[k]) for k in canon), text
    out = write_hf_checkpoint(tmp_path / "out", back, model=spec, max_shard_bytes=30_000)
    assert model_from_hf_config(out) == spec
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = loaded.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 8, 4]])  # longer than the window
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_the_exported_config_builds_the_same_computation() -> None:
    """``hf_config()`` alone (no original config) gives transformers the same model:
    equal logits from equal weights, for both families."""
    for name in sorted(CONFIGS):
        model = _real_model(name)
        spec = model_from_hf_config(CONFIGS[name])
        cfg = spec.hf_config()
        config = transformers.AutoConfig.for_model(str(cfg.pop("model_type")), **cfg)
        again = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        again.load_state_dict(model.state_dict(), strict=True)
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        assert torch.equal(model(ids).logits, again(ids).logits), name
        assert type(again).__name__ == spec.family.architecture
