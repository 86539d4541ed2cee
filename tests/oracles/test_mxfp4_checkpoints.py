"""MXFP4 checkpoints (gpt-oss's experts) read as transformers dequantises them on CPU.

A tiny gpt-oss that transformers builds and saves (bf16), its stacked experts then
written as MXFP4 blocks and scales drawn at random (every byte, exponents around 127)
with the published ``quantization_config``: ``HfCheckpoint``, ``convert_to_local`` and
``load_into`` read it bitwise as ``from_pretrained(...,
quantization_config=Mxfp4Config(dequantize=True))`` does, and as the blocks' values
decoded here by hand (e2m1 by code, times ``2**(s - 127)``).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

from areal_fn import model_from_hf_config
from areal_fn.errors import ConversionError
from areal_fn.model.hf_memory import hf_state_to_canonical
from areal_fn.model.quantized import Fp8Format
from areal_fn.runtime.hf.convert import convert_back, convert_to_local
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from tests.quantized_util import check_reads_as_plain

GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 64,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "layer_types": ["full_attention"],
}
QUANT = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _by_hand(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[E, in, out]`` bf16 of blocks ``[E, out, in/32, 16]``: each nibble's e2m1 value
    (bit 3 the sign), low nibble first, times ``2**(s - 127)``, transposed."""
    e, out, groups, _ = blocks.shape
    w = torch.empty(e, out, groups * 32, dtype=torch.float64)
    for idx in range(groups * 32):
        nib = (blocks[:, :, idx // 32, (idx % 32) // 2].long() >> (4 * (idx % 2))) & 0xF
        value = torch.tensor(E2M1, dtype=torch.float64)[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
        w[:, :, idx] = value * torch.pow(2.0, scales[:, :, idx // 32].double() - 127)
    return w.to(torch.bfloat16).transpose(1, 2)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("mxfp4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**GPT_OSS)).to(torch.bfloat16)
    model.save_pretrained(base / "bf16")
    stored = load_file(base / "bf16" / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    out, want = {}, {}
    for name, t in stored.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        e, rows, cols = t.shape  # [E, in, out]
        blocks = torch.randint(0, 256, (e, cols, rows // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(117, 137, (e, cols, rows // 32), generator=g, dtype=torch.uint8)
        out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        want[name] = _by_hand(blocks, scales)
    (base / "mxfp4").mkdir()
    save_file(out, str(base / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "bf16" / "config.json").read_text())
    (base / "mxfp4" / "config.json").write_text(json.dumps(config | {"quantization_config": QUANT}))
    return base / "mxfp4", want


def test_reading_equals_transformers_dequantisation(mxfp4_dir):
    path, want = mxfp4_dir
    spec = model_from_hf_config(path)
    with HfCheckpoint(path) as ckpt:
        ckpt.check(spec)
        ours = {n: ckpt.read_full(n) for n in ckpt.names}
        assert ckpt.dtype("model.layers.0.mlp.experts.down_proj") == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True)
    )
    theirs = hf_state_to_canonical(model.state_dict(), spec)
    assert sorted(ours) == sorted(theirs)
    for name, t in ours.items():
        assert t.shape == theirs[name].shape and torch.equal(t, theirs[name].to(t.dtype)), name
    for name, t in want.items():
        assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("alloc", ["fsdp:d2t2", "megatron:t2"])
def test_conversion_and_load_into_read_mxfp4_as_its_dequantisation(mxfp4_dir, tmp_path, alloc):
    path, _ = mxfp4_dir
    spec = model_from_hf_config(path)
    with HfCheckpoint(path) as ckpt:
        plain = {n: ckpt.read_full(n) for n in ckpt.names}
    write_hf_checkpoint(tmp_path / "plain", plain, model=spec)
    check_reads_as_plain(path, tmp_path / "plain", alloc, tmp_path)


def test_blocks_without_scales_are_refused(mxfp4_dir, tmp_path):
    path, _ = mxfp4_dir
    stored = load_file(path / "model.safetensors")
    del stored["model.layers.0.mlp.experts.down_proj_scales"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(stored, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(
        ConversionError,
        match=r"does not hold what its quantization_config \(mxfp4\) says: "
        r"\['model\.layers\.0\.mlp\.experts\.down_proj_blocks without "
        r"model\.layers\.0\.mlp\.experts\.down_proj_scales'\]",
    ):
        HfCheckpoint(Path(bad))


def test_written_back_it_is_bf16_and_fp8_is_refused_for_stacked_experts(mxfp4_dir, tmp_path):
    path, want = mxfp4_dir
    spec = model_from_hf_config(path)
    convert_to_local(path, "fsdp:d2", tmp_path / "ranks")
    convert_back(tmp_path / "ranks", None, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    got = hf_state_to_canonical(plain.state_dict(), spec)
    assert all(torch.equal(got[n], t) for n, t in want.items())
    with pytest.raises(
        ConversionError,
        match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj holds stacked experts "
        r"\(2, 64, 64\) \(gpt-oss\), which FP8 checkpoints store per expert; write this "
        r"model without fp8",
    ):
        convert_back(tmp_path / "ranks", None, tmp_path / "fp8", fp8=Fp8Format(block=(32, 32)))
    assert not (tmp_path / "fp8").exists()
