"""Block FP8 checkpoints in and out, against transformers and DeepSeek-V3's reference.

In: a tiny DeepSeek-V3 that transformers builds, quantised by transformers' own
``Fp8Quantize`` (the op its FP8 quantizer saves with) into DeepSeek-V3's file format,
is read by ``HfCheckpoint``, ``convert_to_local``, ``convert_to_torch_dist`` and
``load_into`` bitwise as
transformers' ``from_pretrained(quantization_config=FineGrainedFP8Config(dequantize=True))``
dequantises it on CPU, and as DeepSeek-V3's ``weight_dequant`` does
(:func:`tests.laws.test_fp8.reference_dequant`). Out: ``convert_back(fp8=)`` and
``areal-fn convert --to-hf --fp8`` write files transformers loads, the tensors
:func:`is_fp8_quantized` names being the ones transformers' FP8 quantizer converts.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils.quantization_config import FineGrainedFP8Config

from areal_fn import ParallelDims, megatron_layout, model_from_hf_config
from areal_fn.cli import main
from areal_fn.errors import ConversionError
from areal_fn.model.hf_memory import hf_memory_view, hf_state_to_canonical
from areal_fn.model.quantized import Fp8Format, is_fp8_quantized, scale_name
from areal_fn.plans.convert import to_megatron, to_megatron_into
from areal_fn.plans.fp8 import fp8_checkpoint_bytes, plan_fp8_shards
from areal_fn.runtime.hf.convert import convert_back, convert_to_local, rank_file, read_local
from areal_fn.runtime.hf.io import HfCheckpoint, read_safetensors_header, write_hf_checkpoint
from areal_fn.runtime.hf.load_into import load_into
from areal_fn.sharding.box import Box
from tests.laws.test_convert_into import assert_bitwise, poisoned_like
from tests.laws.test_fp8 import reference_dequant
from tests.quantized_util import check_reads_as_plain

#: A tiny DeepSeek-V3: MLA (q_a/q_b, kv_a 24 rows, kv_b), a dense layer, an MoE layer
#: with a shared expert.
DS = {
    "model_type": "deepseek_v3",
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "moe_intermediate_size": 16,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "torch_dtype": "bfloat16",
}
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 64,
}


def _bf16_checkpoint(path: Path, config: dict) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def _transformers_quantised(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """``src``'s weights the rule names quantised by transformers' ``Fp8Quantize``,
    written as DeepSeek-V3 publishes them (``x.weight`` + ``x.weight_scale_inv``)."""
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=block)))
    config = json.loads((src / "config.json").read_text())
    fmt = Fp8Format(block=block)
    out = {}
    with HfCheckpoint(src) as ckpt:
        for name in ckpt.names:
            t = ckpt.read_full(name)
            out.update(
                op._quantize_one(name, t) if is_fp8_quantized(name, t.shape, fmt) else {name: t}
            )
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = fmt.quantization_config()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _reference(path: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The canonical tensors of an FP8 checkpoint by DeepSeek-V3's ``weight_dequant``."""
    raw = _stored(path)
    return {
        n: reference_dequant(t, raw[scale_name(n)], block) if scale_name(n) in raw else t
        for n, t in raw.items()
        if not n.endswith("_scale_inv")
    }


def _transformers_dequantised(path: Path, spec) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    return hf_state_to_canonical(model.state_dict(), spec)


def _read(path: Path) -> dict[str, torch.Tensor]:
    with HfCheckpoint(path) as ckpt:
        return {n: ckpt.read_full(n) for n in ckpt.names}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    bf16 = _bf16_checkpoint(base / "bf16", DS)
    return bf16, _transformers_quantised(bf16, base / "fp8", (8, 8))


def test_reading_equals_transformers_and_deepseeks_dequantisation(fp8_dirs):
    bf16, fp8 = fp8_dirs
    spec = model_from_hf_config(fp8)
    ours = _read(fp8)
    raw = _stored(fp8)
    assert sum(n.endswith("_scale_inv") for n in raw) == 22  # every decoder Linear
    theirs = _transformers_dequantised(fp8, spec)
    reference = _reference(fp8, (8, 8))
    assert sorted(ours) == sorted(theirs) == sorted(t.name for t in spec.tensors)
    original = _read(bf16)
    for name, t in ours.items():
        assert torch.equal(t, reference[name]), name
        if scale_name(name) not in raw:  # stored as it is (transformers keeps a bias in fp32)
            assert torch.equal(t, original[name]), name
            continue
        assert t.dtype == theirs[name].dtype == torch.bfloat16, name
        assert torch.equal(t, theirs[name]), name
        # within FP8's rounding of the weights quantised
        assert torch.allclose(t.float(), original[name].float(), rtol=2**-4, atol=2**-6), name


def test_blocks_cut_at_the_edge_follow_deepseeks_reference(tmp_path):
    """16x16 blocks cut kv_a_proj_with_mqa's 24 rows and kv_b_proj's... rows: ours is
    the reference everywhere; transformers 5.25's dequantisation derives the block from
    the scale grid (24 rows / 2 scale rows = 12) and so differs exactly on those."""
    bf16 = _bf16_checkpoint(tmp_path / "bf16", DS)
    spec = model_from_hf_config(bf16)
    write_hf_checkpoint(
        tmp_path / "fp8",
        _read(bf16),
        config=json.loads((bf16 / "config.json").read_text()),
        model=spec,
        fp8=Fp8Format(block=(16, 16)),
    )
    ours, reference = _read(tmp_path / "fp8"), _reference(tmp_path / "fp8", (16, 16))
    assert all(torch.equal(ours[n], reference[n]) for n in ours)
    theirs = _transformers_dequantised(tmp_path / "fp8", spec)
    differ = sorted(n for n in ours if not torch.equal(ours[n], theirs[n]))
    cut = sorted(
        t.name
        for t in spec.tensors
        if is_fp8_quantized(t.name, t.shape, Fp8Format()) and (t.shape[0] % 16 or t.shape[1] % 16)
    )
    assert (
        differ == cut == [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in (0, 1)]
    )


@pytest.mark.parametrize("alloc", ["megatron:t2", "fsdp:d2t2"])
def test_conversion_and_load_into_read_fp8_as_its_dequantisation(fp8_dirs, tmp_path, alloc):
    _, fp8 = fp8_dirs
    spec = model_from_hf_config(fp8)
    plain = tmp_path / "dequantised"
    write_hf_checkpoint(plain, _reference(fp8, (8, 8)), model=spec)
    layout, loaded = check_reads_as_plain(fp8, plain, alloc, tmp_path)
    assert all(got == want for got, want in loaded)
    for rank in range(layout.world_size):
        a = read_local(tmp_path / "a" / rank_file(rank))
        with HfCheckpoint(fp8) as ckpt:
            built = to_megatron(ckpt.read, layout, rank)
            assert_bitwise({n: built[n] for n in a}, a)
            into = poisoned_like(a)  # what the engines' load_canonical(reader) runs
            to_megatron_into(ckpt.read, layout, rank, out=into, cast=True)
            assert_bitwise(into, a)


def test_writing_fp8_transformers_loads_and_the_bytes_of_the_plan(fp8_dirs, tmp_path):
    bf16, _ = fp8_dirs
    spec = model_from_hf_config(bf16)
    convert_to_local(bf16, "megatron:t2", tmp_path / "ranks")
    fmt = Fp8Format(block=(8, 8))
    convert_back(tmp_path / "ranks", None, tmp_path / "out", fp8=fmt)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [8, 8],
    }
    raw = _stored(tmp_path / "out")
    quantised = sorted(n for n, t in raw.items() if t.dtype == torch.float8_e4m3fn)
    assert quantised == sorted(
        t.name for t in spec.tensors if is_fp8_quantized(t.name, t.shape, fmt)
    )
    ours = _read(tmp_path / "out")
    theirs = _transformers_dequantised(tmp_path / "out", spec)
    reference = _reference(tmp_path / "out", (8, 8))
    original = _read(bf16)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name].to(t.dtype)) and torch.equal(t, reference[name]), name
        assert torch.allclose(t.float(), original[name].float(), rtol=2**-4, atol=2**-6), name
    # bytes: the files' data against the plans (values and the scales each writes)
    _, start, size = read_safetensors_header(tmp_path / "out" / "model.safetensors")
    fp8_data = size - start
    _, start, size = read_safetensors_header(bf16 / "model.safetensors")
    bf16_data = size - start
    saved = sum(
        2 * t.numel() - plan_fp8_shards(tuple(t.shape), [Box.full(t.shape)], block=(8, 8)).bytes(0)
        for n, t in original.items()
        if n in quantised
    )
    assert fp8_data == bf16_data - saved
    fp8_bytes, plain_bytes = fp8_checkpoint_bytes(spec, fmt)
    assert plain_bytes - fp8_bytes == saved


def test_an_fp8_source_written_back_without_fp8_drops_its_quantization_config(fp8_dirs, tmp_path):
    _, fp8 = fp8_dirs
    convert_to_local(fp8, "megatron:t2", tmp_path / "ranks")
    convert_back(tmp_path / "ranks", None, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    spec = model_from_hf_config(fp8)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    reference = _reference(fp8, (8, 8))
    got = hf_state_to_canonical(plain.state_dict(), spec)
    assert all(torch.equal(got[n], reference[n]) for n in reference)


def _transformers_choice(config: dict, keep: list[str] | None) -> set[str]:
    """The canonical tensors whose modules transformers' FP8 quantizer replaces."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    q = FineGrainedFP8HfQuantizer(
        FineGrainedFP8Config(weight_block_size=(8, 8), modules_to_not_convert=keep),
        pre_quantized=True,
    )
    q._process_model_before_weight_loading(model)
    memory = {m.name: m for m in hf_memory_view(model_from_hf_config(config))}
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            out.add(f"{name}.weight")
        elif isinstance(module, FP8Experts):
            for proj in ("gate_up_proj", "down_proj"):
                out.update(p.canonical for p in memory[f"{name}.{proj}"].pieces)
    return out


@pytest.mark.parametrize(
    ("config", "keep"),
    [
        (DS, None),
        (DS, ["model.layers.1.self_attn", "shared_experts.up_proj", "lm_head"]),
        (QWEN3_MOE, None),
    ],
    ids=["deepseek_v3", "deepseek_v3-kept", "qwen3_moe"],
)
def test_the_rule_is_transformers_choice(config, keep):
    spec = model_from_hf_config(config)
    fmt = Fp8Format(block=(8, 8), keep=tuple(keep or ()))
    ours = {t.name for t in spec.tensors if is_fp8_quantized(t.name, t.shape, fmt)}
    assert ours == _transformers_choice(config, keep)


def test_the_cli_writes_fp8_and_refuses_it_elsewhere(fp8_dirs, tmp_path, capsys):
    bf16, _ = fp8_dirs
    convert_to_local(bf16, "megatron:t2", tmp_path / "ranks")
    assert (
        main(["convert", str(tmp_path / "ranks"), str(tmp_path / "out"), "--to-hf", "--fp8", "8x8"])
        == 0
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ] == [8, 8]
    assert main(["convert", str(bf16), "megatron:t2", str(tmp_path / "x"), "--fp8", "8x8"]) == 2
    err = capsys.readouterr().err
    assert (
        "--fp8 8x8 writes the HF checkpoint of --to-hf from rank files as block FP8; "
        "reading an HF checkpoint reads its FP8 weights as they are: drop it" in err
    )
    assert (
        main(["convert", str(tmp_path / "ranks"), str(tmp_path / "y"), "--to-hf", "--fp8", "0x8"])
        == 2
    )
    assert (
        "--fp8 '0x8' is not a block size; pass ROWSxCOLS, e.g. --fp8 128x128"
        in capsys.readouterr().err
    )


def test_files_that_do_not_match_their_quantization_config_are_refused(fp8_dirs, tmp_path):
    _, fp8 = fp8_dirs
    raw = _stored(fp8)
    name = "model.layers.0.self_attn.o_proj.weight"
    for what, change, message in [
        ("no scale", lambda r: r.pop(scale_name(name)), rf"{name} is FP8 without {name}_scale_inv"),
        (
            "scale shape",
            lambda r: r.update({scale_name(name): r[scale_name(name)][:, :1].contiguous()}),
            r"float32 scales of 8x8 blocks are \(4, 2\)",
        ),
    ]:
        bad = dict(raw)
        change(bad)
        d = tmp_path / what.replace(" ", "_")
        d.mkdir()
        save_file(bad, str(d / "model.safetensors"))
        (d / "config.json").write_text((fp8 / "config.json").read_text())
        with pytest.raises(
            ConversionError, match=r"does not hold what its quantization_config says.*" + message
        ):
            HfCheckpoint(d)


def test_a_torch_dist_checkpoint_of_an_fp8_source_holds_its_dequantisation(tmp_path):
    """``convert_to_torch_dist`` reads through ``HfCheckpoint``: the torch_dist checkpoint
    written back to HF is the reference dequantisation, its config without FP8."""
    from areal_fn.runtime.checkpoint.megatron_convert import (
        convert_to_torch_dist,
        convert_torch_dist_to_hf,
    )

    bf16 = _bf16_checkpoint(tmp_path / "bf16", QWEN3_MOE | {"torch_dtype": "bfloat16"})
    fp8 = _transformers_quantised(bf16, tmp_path / "fp8", (8, 8))
    convert_to_torch_dist(fp8, "megatron:d2e2", tmp_path / "td", layer_spec="local")
    convert_torch_dist_to_hf(tmp_path / "td", tmp_path / "back", trust_pickle=True)
    reference, back = _reference(fp8, (8, 8)), _read(tmp_path / "back")
    assert sorted(back) == sorted(reference)
    assert all(torch.equal(back[n], reference[n]) for n in reference)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_a_sharded_fp8_checkpoint_reads_as_one(fp8_dirs, tmp_path):
    """Written in shards of at most 2 kB (a scale may lie in another file than its
    weight): the readers and transformers read what the single file holds."""
    bf16, fp8 = fp8_dirs
    spec = model_from_hf_config(fp8)
    fmt = Fp8Format(block=(8, 8))
    whole = tmp_path / "whole"
    config = json.loads((bf16 / "config.json").read_text())
    write_hf_checkpoint(whole, _read(bf16), config=config, model=spec, fp8=fmt)
    sharded = tmp_path / "sharded"
    write_hf_checkpoint(
        sharded, _read(bf16), config=config, model=spec, fp8=fmt, max_shard_bytes=2048
    )
    assert len(list(sharded.glob("model-*.safetensors"))) > 5
    ours = _read(sharded)
    assert all(torch.equal(ours[n], t) for n, t in _read(whole).items())
    theirs = _transformers_dequantised(sharded, spec)
    assert all(torch.equal(ours[n], theirs[n].to(ours[n].dtype)) for n in ours)
    layout = megatron_layout(spec, ParallelDims(tp=2))
    with HfCheckpoint(whole) as ckpt:
        want = to_megatron(ckpt.read, layout, 1)
    out = poisoned_like(want)
    load_into(sharded, layout, 1, out=out)
    assert_bitwise(out, want)
