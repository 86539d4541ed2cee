"""``areal-fn convert`` and :mod:`areal_fn.runtime.convert_io` on real checkpoints.

A tiny transformers model is saved with ``save_pretrained``; the CLI converts it to
per-rank files, :func:`convert_back` turns those into an HF checkpoint again, and
``from_pretrained`` of the result equals the original bitwise. Bad inputs fail with
one line (the CLI: exit 2) and write nothing.
"""

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open

from areal_fn.cli import main
from areal_fn.errors import ConversionError
from areal_fn.model import model_from_hf_config
from areal_fn.runtime.convert_io import (
    ConvertSummary,
    convert_back,
    convert_to_local,
    rank_file,
    read_local,
)

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=False,
    ),
    "llama_tied": dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=90,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=80,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[0],
        tie_word_embeddings=False,
    ),
}

#: (family, allocation): TP, PP, VPP, EP, tied embeddings split across stages
ROUND_TRIPS = [
    ("qwen2", "megatron:t2p2"),
    ("qwen2", "megatron:d2p2v2"),
    ("llama_tied", "megatron:t2p2"),
    ("qwen3_moe", "megatron:d2p2e2"),
    ("qwen3_moe", "megatron:(attn:d1p2t2|ffn:d1p2e2)"),
    ("qwen2", "megatron:d2t2"),
]


def _save(root: Path, family: str, seed: int = 0) -> tuple[Path, Any]:
    cfg = dict(CONFIGS[family])
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / f"{family}-hf"
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("convert_cli")
    return {family: _save(root, family) for family in CONFIGS}


def _state(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


def _equal_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    unequal = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert unequal == []


@pytest.mark.parametrize(("family", "allocation"), ROUND_TRIPS)
def test_cli_convert_then_back_is_bitwise_the_original(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, family: str, allocation: str
) -> None:
    src, model = saved[family]
    local, back = tmp_path / "local", tmp_path / "back"
    assert main(["convert", str(src), allocation, str(local)]) == 0
    files = sorted(p.name for p in local.iterdir())
    assert [f for f in files if f.startswith("rank")] == [rank_file(r) for r in range(4)]
    spec = model_from_hf_config(src)  # the CLI's output may lack config.json
    summary = convert_back(local, allocation, back, model=spec, max_shard_bytes=64 << 10)
    assert summary.ranks == (0, 1, 2, 3)
    assert summary.tensors == len(spec.tensors)
    names = sorted(p.name for p in back.iterdir())
    assert "config.json" in names and "model.safetensors.index.json" in names  # sharded
    assert model_from_hf_config(back) == model_from_hf_config(src)
    _equal_bitwise(_state(back), model.state_dict())


def test_convert_to_local_writes_what_the_cli_writes(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen3_moe"]
    allocation = "megatron:d2p2e2"
    assert main(["convert", str(src), allocation, str(tmp_path / "cli")]) == 0
    names: list[str] = []
    summary = convert_to_local(src, allocation, tmp_path / "api", progress=names.append)
    assert isinstance(summary, ConvertSummary)
    assert summary.ranks == (0, 1, 2, 3) and summary.tensors == len(names) > 0
    for r in range(4):
        cli_file, api_file = (tmp_path / d / rank_file(r) for d in ("cli", "api"))
        with safe_open(cli_file, "pt") as a, safe_open(api_file, "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
            meta_cli, meta_api = a.metadata(), b.metadata()
        assert meta_api["allocation"] == meta_cli["allocation"] == allocation
        assert meta_api["rank"] == meta_cli["rank"] == str(r)
        assert meta_api["world_size"] == "4"
    assert (tmp_path / "api" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    # the allocation recorded in the files is enough to convert back
    convert_back(tmp_path / "api", None, tmp_path / "back")
    _equal_bitwise(_state(tmp_path / "back"), _state(src))


def test_one_rank_alone_equals_that_rank_of_all(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen2"]
    convert_to_local(src, "megatron:t2p2", tmp_path / "all")
    convert_to_local(src, "megatron:t2p2", tmp_path / "one", ranks=[3])
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", rank_file(3)]
    a, b = read_local(tmp_path / "all" / rank_file(3)), read_local(tmp_path / "one" / rank_file(3))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # adding another rank to an existing directory needs overwrite=True
    with pytest.raises(ConversionError, match="already exists; pass overwrite=True"):
        convert_to_local(src, "megatron:t2p2", tmp_path / "one", ranks=[0])
    convert_to_local(src, "megatron:t2p2", tmp_path / "one", ranks=[0, 1, 2], overwrite=True)
    convert_back(tmp_path / "one", "megatron:t2p2", tmp_path / "back")
    _equal_bitwise(_state(tmp_path / "back"), _state(src))


def test_read_local_views_are_zero_copy_and_private(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen2"]
    convert_to_local(src, "megatron:t2p2", tmp_path / "local")
    path = tmp_path / "local" / rank_file(0)
    before = path.read_bytes()
    views = read_local(path)
    with safe_open(path, "pt") as f:
        assert sorted(views) == sorted(f.keys())
        assert all(torch.equal(views[k], f.get_tensor(k)) for k in views)
    first = next(iter(views.values()))
    first.add_(1.0)  # copy-on-write: the file is untouched
    assert path.read_bytes() == before


# ------------------------------------------------------------------ bad input


def test_cli_refuses_a_checkpoint_of_another_model(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    # the weights of qwen2, the config of qwen3_moe: the installed command, one line, exit 2
    src = tmp_path / "mixed"
    src.mkdir()
    weights, _ = saved["qwen2"]
    other, _ = saved["qwen3_moe"]
    (src / "model.safetensors").symlink_to(weights / "model.safetensors")
    (src / "config.json").write_bytes((other / "config.json").read_bytes())
    dst = tmp_path / "out"
    exe = Path(sys.executable).with_name("areal-fn")
    proc = subprocess.run(
        [str(exe), "convert", str(src), "megatron:t2", str(dst)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("areal-fn: error: canonical tensors do not match the model")
    assert "missing" in lines[0] and "unexpected" in lines[0]
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed"]  # no temporary left


def test_convert_back_refuses_files_of_another_model(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen2"]
    other, _ = saved["llama_tied"]
    convert_to_local(src, "megatron:t2p2", tmp_path / "local")
    back = tmp_path / "back"
    with pytest.raises(ConversionError, match=r"config.json describes another model than model="):
        convert_back(tmp_path / "local", "megatron:t2p2", back, model=model_from_hf_config(other))
    (tmp_path / "local" / "config.json").unlink()
    with pytest.raises(ConversionError, match=r"says model_type='qwen2', expected 'llama'"):
        convert_back(tmp_path / "local", "megatron:t2p2", back, model=model_from_hf_config(other))
    # same model type, other sizes: the local tensors are listed
    bigger = model_from_hf_config({**CONFIGS["qwen2"], "hidden_size": 64})
    with pytest.raises(ConversionError, match=r"local states do not match.*mis-shaped"):
        convert_back(tmp_path / "local", "megatron:t2p2", back, model=bigger)
    assert not back.exists()


def test_convert_back_refuses_other_allocations_and_missing_ranks(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen2"]
    local, back = tmp_path / "local", tmp_path / "back"
    convert_to_local(src, "megatron:t2p2", local)
    with pytest.raises(
        ConversionError, match=r"says allocation='megatron:d1p2t2', expected 'megatron:d2p2'"
    ):
        convert_back(local, "megatron:d2p2", back)
    with pytest.raises(ConversionError, match=r"files for ranks \[2, 3\] outside"):
        convert_back(local, "megatron:t2", back)
    (local / rank_file(2)).unlink()
    with pytest.raises(ConversionError, match=r"no file for ranks \[2\]"):
        convert_back(local, None, back)
    assert not back.exists()
    convert_to_local(src, "megatron:t2p2", local, ranks=[2], overwrite=True)
    back.mkdir()
    with pytest.raises(ConversionError, match="already exists; pass overwrite=True"):
        convert_back(local, None, back)
    with pytest.raises(ConversionError, match="holds no rank"):
        convert_back(back, None, tmp_path / "x")


def test_refuses_bad_ranks_and_unreadable_files(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen2"]
    with pytest.raises(
        ConversionError, match=r"ranks=\[4, 1, 1\]: out of range \[4\], repeated \[1\]"
    ):
        convert_to_local(src, "megatron:t2p2", tmp_path / "local", ranks=[4, 1, 1])
    assert not (tmp_path / "local").exists()
    convert_to_local(src, "megatron:t2p2", tmp_path / "local")
    (tmp_path / "local" / rank_file(1)).write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(
        ConversionError, match=r"rank00001.safetensors is not a readable safetensors"
    ):
        convert_back(tmp_path / "local", None, tmp_path / "back")
    assert not (tmp_path / "back").exists()
