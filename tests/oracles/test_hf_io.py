"""HF checkpoint IO against real transformers models and real safetensors files."""

import json

import pytest
import torch
import transformers

from areal_fn import Box, ConversionError, ParallelDims, megatron_layout, model_from_hf_config
from areal_fn.model.hf_memory import canonical_to_hf_state, hf_state_to_canonical
from areal_fn.plans.convert import to_hf, to_megatron
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint

CONFIGS = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=False,
    ),
    "llama-tied": dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=90,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=80,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        tie_word_embeddings=False,
    ),
    # stacked biased experts: strided, transposed pieces under Megatron
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=80,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


def real_model(name):
    cfg = dict(CONFIGS[name])
    mt = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(mt, **cfg)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32), config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_read_slices_and_write_loadable_checkpoint(tmp_path, name):
    model, _config = real_model(name)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    spec = model_from_hf_config(tmp_path / "hf")
    with HfCheckpoint(tmp_path / "hf") as ckpt:
        ckpt.check(spec)
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
        canon = hf_state_to_canonical(model.state_dict(), spec)
        for t in spec.tensors:
            box = Box(ranges=tuple((d // 3, d - d // 4) for d in t.shape))
            assert torch.equal(ckpt.read(t.name, box), canon[t.name][box.slices()])
        # conversion straight from the files, Megatron t2 layout, back to HF
        layout = megatron_layout(spec, ParallelDims(dp=1, tp=2))
        states = {r: to_megatron(ckpt.read, layout, r) for r in range(2)}
    back = to_hf(states, layout)
    out = write_hf_checkpoint(tmp_path / "out", back, model=spec, max_shard_bytes=30_000)
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and any(f.startswith("model-00001-of-") for f in files)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    ref = model.state_dict()
    got = loaded.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    ids = torch.tensor([[1, 5, 7, 3]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert canonical_to_hf_state(back, spec).keys() == ref.keys()


def test_refuses_mismatched_checkpoints(tmp_path):
    model, _ = real_model("qwen2")
    spec = model_from_hf_config(model.config.to_dict())
    canon = hf_state_to_canonical(model.state_dict(), spec)
    missing = {k: v for k, v in canon.items() if not k.endswith("lm_head.weight")}
    with pytest.raises(ConversionError, match=r"missing 1: \['lm_head.weight'\]"):
        write_hf_checkpoint(tmp_path / "a", missing, model=spec)
    assert not (tmp_path / "a").exists()
    extra = dict(canon, **{"model.extra.weight": torch.zeros(2)})
    with pytest.raises(ConversionError, match=r"unexpected 1: \['model.extra.weight'\]"):
        write_hf_checkpoint(tmp_path / "b", extra, model=spec)
    bad = dict(canon)
    bad["model.norm.weight"] = torch.zeros(31)
    with pytest.raises(ConversionError, match=r"model.norm.weight: got \(31,\), expected \(32,\)"):
        write_hf_checkpoint(tmp_path / "c", bad, model=spec)
    write_hf_checkpoint(tmp_path / "d", canon, model=spec)
    with pytest.raises(ConversionError, match=r"already exists; pass overwrite=True"):
        write_hf_checkpoint(tmp_path / "d", canon, model=spec)
    (tmp_path / "e").mkdir()
    with pytest.raises(ConversionError, match=r"holds neither model.safetensors nor"):
        HfCheckpoint(tmp_path / "e")
    idx = tmp_path / "f"
    idx.mkdir()
    (idx / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "missing.safetensors"}})
    )
    with pytest.raises(ConversionError, match=r"is named by the index but does not exist"):
        HfCheckpoint(idx).read("x", Box(ranges=((0, 1),)))


def test_config_bytes_and_other_files_are_written_as_given(tmp_path):
    model, _ = real_model("qwen2")
    spec = model_from_hf_config(CONFIGS["qwen2"])
    canon = hf_state_to_canonical(model.state_dict(), spec)
    raw = json.dumps({**CONFIGS["qwen2"], "eos_token_id": [1, 2], "zzz": None}, indent=1).encode()
    files = {"tokenizer.json": b'{"version": "1.0"}', "tokenizer.model": bytes(range(256))}
    out = write_hf_checkpoint(tmp_path / "out", canon, config=raw, files=files, model=spec)
    assert (out / "config.json").read_bytes() == raw
    assert all((out / n).read_bytes() == b for n, b in files.items())
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id == [1, 2]


@pytest.mark.parametrize(
    ("files", "config", "message"),
    [
        (
            {"model.safetensors": b""},
            None,
            r"HfFiles.files names 'model.safetensors'; carried files are plain top-level names, "
            r"not hidden, not config.json \(that is HfFiles.config\) and not weight files",
        ),
        ({"config.json": b"{}"}, None, r"HfFiles.files names 'config.json'"),
        ({"sub/tokenizer.json": b"{}"}, None, r"HfFiles.files names 'sub/tokenizer.json'"),
        ({".hidden": b""}, None, r"HfFiles.files names '.hidden'"),
        ({"vocab.txt": "text"}, None, r"HfFiles.files\['vocab.txt'\] is a str, not bytes"),
        ({}, b"{nope", r"HfFiles.config is not JSON text \(.*\); give config.json as read"),
        ({}, b"[1]", r"HfFiles.config holds a JSON list, not an object \(a config.json\)"),
    ],
)
def test_carried_files_are_checked_before_anything_is_written(tmp_path, files, config, message):
    spec = model_from_hf_config(CONFIGS["qwen2"])
    with pytest.raises(ConversionError, match=message):
        write_hf_checkpoint(tmp_path / "out", {}, config=config, files=files, model=spec)
    assert not (tmp_path / "out").exists()


def test_read_hf_files_needs_a_config(tmp_path):
    from areal_fn.runtime.hf.files import read_hf_files

    with pytest.raises(
        ConversionError, match=r"has no config.json; an HF model directory needs one"
    ):
        read_hf_files(tmp_path)
    hf = read_hf_files(tmp_path, config={"model_type": "qwen2"})
    assert hf.skipped == (
        ("config.json", f"absent from {tmp_path}; regenerated from the model spec"),
    )
