"""``areal-fn convert`` and :mod:`areal_fn.runtime.hf.convert` on real checkpoints.

A tiny transformers model is saved with ``save_pretrained``; the CLI converts it to
per-rank files, :func:`convert_back` turns those into an HF checkpoint again, and
``from_pretrained`` of the result equals the original bitwise. Bad inputs fail with
one line (the CLI: exit 2) and write nothing.
"""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import SafetensorError, safe_open

from areal_fn.cli import main
from areal_fn.errors import ConversionError
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.hf.convert import (
    ConvertSummary,
    convert_back,
    convert_to_local,
    rank_file,
    read_local,
)
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from areal_fn.strategy.allocation import ParallelDims

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
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "config.json",
        "generation_config.json",  # save_pretrained wrote it: carried like the config
        rank_file(3),
    ]
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
    with pytest.raises(ConversionError) as short:
        convert_back(local, "megatron:d2p2", back)
    assert str(short.value) == (
        f"the rank files in {local} were written for megatron:d1p2t2, not megatron:d2p2; pass "
        "megatron:d1p2t2, or leave the allocation out (it is read from the files)"
    )
    t2 = megatron_layout(model_from_hf_config(src), ParallelDims(tp=2))
    with pytest.raises(ConversionError, match=r"files for ranks \[2, 3\] outside"):
        convert_back(local, t2, back)
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


# ------------------------------------------------------------------ damaged files, full disks


def _header_len(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def _garble_header(data: bytes) -> bytes:
    n = _header_len(data)
    return data[:8] + b"\xff" * n + data[8 + n :]


def _edit_header(edit: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    """Change the first tensor's header entry (the header re-serialised, the data kept)."""

    def damage(data: bytes) -> bytes:
        n = _header_len(data)
        header = json.loads(data[8 : 8 + n])
        edit(header[sorted(k for k in header if k != "__metadata__")[0]])
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw + data[8 + n :]

    return damage


_offsets_past_the_end = _edit_header(lambda e: e.update(data_offsets=[0, 10**9]))


#: (name, damage of model.safetensors, what the one line says after "is not a readable
#: safetensors file: ")
DAMAGED: list[tuple[str, Callable[[bytes], bytes], str]] = [
    (
        "truncated",
        lambda d: d[: len(d) // 2],
        r"its tensors' data ends at byte \d+, the file has \d+ bytes; the file is truncated",
    ),
    (
        "header cut short",
        lambda d: d[: 8 + _header_len(d) // 2],
        r"its header length says \d+ bytes, \d+ follow; the file is truncated",
    ),
    (
        "garbled header",
        _garble_header,
        r"its header is not JSON \(UnicodeDecodeError: [^;]*\); the file is corrupted",
    ),
    (
        "header offsets past the end",
        _offsets_past_the_end,
        r"its tensors' data ends at byte 1000\d+, the file has \d+ bytes; the file is truncated",
    ),
    (
        "unknown dtype",
        _edit_header(lambda e: e.update(dtype="F128")),
        r"safetensors refuses it \(SafetensorError: [^;]*\); the file is corrupted",
    ),
    (
        "garbled header length",
        lambda d: b"\xff" * 8 + d[8:],
        r"its header length says 18446744073709551615 bytes, \d+ follow; the file is truncated",
    ),
    (
        "empty",
        lambda d: b"",
        r"it has 0 bytes, not even the 8 of the header length; the file is truncated",
    ),
]
_REMEDY = r" or corrupted: download or save it again"


@pytest.mark.parametrize(
    ("damage", "message"), [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED]
)
def test_cli_refuses_a_damaged_safetensors_file(
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[bytes], bytes],
    message: str,
) -> None:
    weights, _ = saved["qwen2"]
    src = tmp_path / "src"
    shutil.copytree(weights, src)
    f = src / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    assert main(["convert", str(src), "megatron:t2p2", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    line = err.strip()
    prefix = rf"areal-fn: error: {re.escape(str(f))} is not a readable safetensors file: "
    tail = _REMEDY if message.endswith("truncated") else ": download or save it again"
    assert re.fullmatch(prefix + message + tail, line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary


def test_cli_refuses_a_truncated_shard(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights, _ = saved["qwen2"]
    src = tmp_path / "src"
    with HfCheckpoint(weights) as hf:
        tensors = {n: hf.read_full(n) for n in hf.names}
    config = json.loads((weights / "config.json").read_text())
    write_hf_checkpoint(src, tensors, config=config, max_shard_bytes=64 << 10)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].write_bytes(shards[-1].read_bytes()[:-100])
    assert main(["convert", str(src), "megatron:t2p2", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"areal-fn: error: {re.escape(str(shards[-1]))} is not a readable safetensors file: its "
        r"tensors' data ends at byte \d+, the file has \d+ bytes; the file is truncated" + _REMEDY,
        line,
    ), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_convert_back_refuses_a_rank_file_with_a_garbled_header_length(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = saved["qwen2"]
    local = tmp_path / "local"
    convert_to_local(src, "megatron:t2p2", local)
    f = local / rank_file(2)
    f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])
    with pytest.raises(
        ConversionError,
        match=r"rank00002\.safetensors is not a readable safetensors file: its header length says "
        r"18446744073709551615 bytes, \d+ follow; the file is truncated or corrupted",
    ):
        convert_back(local, None, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def _full_disk(real: Callable[..., Any]) -> Callable[..., Any]:
    """``save_file`` on a full disk: part of the file is written, then the library's error."""

    def save_file(tensors: Any, filename: str, metadata: Any = None) -> None:
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 3)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    return save_file


_NO_SPACE = r"No space left on device \(ENOSPC\); free space on the disk of \S+ or write elsewhere"


@pytest.mark.parametrize(
    "case", ["convert", "convert one rank into a directory", "convert --to-hf"]
)
def test_cli_onto_a_full_disk_says_one_line_and_leaves_nothing(
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    import areal_fn.runtime.hf.convert as convert_io
    import areal_fn.runtime.hf.io as hf_io

    src, _ = saved["qwen2"]
    out = tmp_path / "out"
    if case == "convert":
        args = ["convert", str(src), "megatron:t2p2", str(out)]
        monkeypatch.setattr(convert_io, "save_file", _full_disk(convert_io.save_file))
        what = rf"{re.escape(str(out))}/rank00000\.safetensors"
        left = rf"nothing was written to {re.escape(str(out))}"
    elif case == "convert one rank into a directory":
        convert_to_local(src, "megatron:t2p2", out, ranks=[0])
        args = ["convert", str(src), "megatron:t2p2", str(out), "--rank", "1", "--overwrite"]
        monkeypatch.setattr(convert_io, "save_file", _full_disk(convert_io.save_file))
        what = rf"{re.escape(str(out))}/rank00001\.safetensors"
        left = rf"{re.escape(str(out))} holds what it held before"
    else:
        local = tmp_path / "local"
        convert_to_local(src, "megatron:t2p2", local)
        args = ["convert", str(local), "megatron:t2p2", str(out), "--to-hf"]
        monkeypatch.setattr(hf_io, "save_file", _full_disk(hf_io.save_file))
        what = rf"{re.escape(str(out))} \(its shard 1\)"
        left = rf"nothing was written to {re.escape(str(out))}"
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None
    listing = sorted(p.name for p in tmp_path.iterdir())
    assert main(args) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1, line
    assert re.fullmatch(rf"areal-fn: error: cannot write {what}: {_NO_SPACE}; {left}", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no temporary directory left
    if before is not None:  # no temporary file left, the files there untouched
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_write_into_a_read_only_place_says_so(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import areal_fn.runtime.hf.io as hf_io

    def save_file(tensors: Any, filename: str, metadata: Any = None) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", filename)

    monkeypatch.setattr(hf_io, "save_file", save_file)
    with HfCheckpoint(saved["qwen2"][0]) as hf:
        tensors = {n: hf.read_full(n) for n in hf.names}
    out = tmp_path / "hf"
    with pytest.raises(
        ConversionError,
        match=rf"^cannot write {re.escape(str(out))} \(its shard 1\): Permission denied \(EACCES\); "
        rf"check that {re.escape(str(tmp_path))} can be written to, or write elsewhere; nothing was "
        rf"written to {re.escape(str(out))}$",
    ):
        write_hf_checkpoint(out, tensors)
    assert list(tmp_path.iterdir()) == []


def test_cli_config_copy_onto_a_full_disk(
    saved: dict[str, tuple[Path, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, _ = saved["qwen2"]
    out = tmp_path / "out"
    real = Path.write_bytes

    def write_bytes(self: Path, data: Any) -> int:
        if str(self).startswith(str(tmp_path)) and "config.json" in self.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    assert main(["convert", str(src), "megatron:t2p2", str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"areal-fn: error: cannot write {re.escape(str(out))}/config\.json: {_NO_SPACE}; nothing "
        rf"was written to {re.escape(str(out))}",
        line,
    ), line
    assert list(tmp_path.iterdir()) == []


def test_installed_cli_past_the_file_size_limit(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """The real thing: the kernel refuses a write (a file size limit; a full disk is alike),
    safetensors raises its own error; one line, exit 2, nothing left."""
    src, _ = saved["qwen2"]
    out = tmp_path / "out"
    exe = Path(sys.executable).with_name("areal-fn")
    limit = (
        "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", limit, str(exe), "convert", str(src), "megatron:t2p2", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        rf"areal-fn: error: cannot write {re.escape(str(out))}/rank00000\.safetensors: File too "
        r"large \(EFBIG\); raise the limit on file size \(ulimit -f\) or write elsewhere; nothing "
        rf"was written to {re.escape(str(out))}",
        lines[0],
    ), lines[0]
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ config, tokenizer, ...


def test_convert_round_trip_carries_config_tokenizer_and_generation_config(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HF -> per rank -> HF gives back config.json, generation_config.json and every
    tokenizer file byte for byte; what cannot be carried is named, not dropped silently."""
    from tests.hf_dir_util import NOT_CARRIED, add_hf_extras

    src = tmp_path / "src"
    shutil.copytree(saved["llama_tied"][0], src)
    carried = add_hf_extras(src, json.loads((src / "config.json").read_text()))
    local, back = tmp_path / "local", tmp_path / "back"
    assert main(["convert", str(src), "megatron:t2p2", str(local)]) == 0
    assert main(["convert", str(local), "megatron:t2p2", str(back), "--to-hf"]) == 0
    out = capsys.readouterr().out
    for d in (local, back):
        for name, data in carried.items():
            assert (d / name).read_bytes() == data, (d, name)
        assert not any((d / n).exists() for n in NOT_CARRIED), sorted(os.listdir(d))
    assert "carried config.json, README.md, chat_template.jinja, generation_config.json" in out
    assert "not carried: .gitattributes (hidden), original (a directory; only top-level" in out
    assert "pytorch_model.bin (weights; the converted or saved weights replace them)" in out
    tok = transformers.AutoTokenizer.from_pretrained(back)
    assert tok("hello world")["input_ids"] == [1, 2]
    assert transformers.GenerationConfig.from_pretrained(back).eos_token_id == [128001, 128009]
    _equal_bitwise(_state(back), _state(src))
