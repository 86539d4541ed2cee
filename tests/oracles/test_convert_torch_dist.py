"""``areal-fn convert ... --format torch_dist`` and ``--to-hf`` of a torch_dist checkpoint.

The installed command runs as a subprocess: a ``transformers`` checkpoint becomes a
Megatron-Core dist checkpoint and back, and ``from_pretrained`` of the result equals the
original bitwise (dense, MoE with stacked and with per-layer keys). OUT is laid out as
Megatron-LM's ``--load OUT`` reads it (its tracker says ``release``, the checkpoint is in
``release/``); ``--to-hf`` also reads the flat layout (the dist checkpoint itself) and a
tracker naming an iteration. That Megatron-Core's own loader reads these checkpoints,
found by Megatron-LM's rules, is ``tests/distributed/test_checkpoint_mcore.py``. Bad
inputs are one line, exit 2, and leave nothing behind.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

EXE = Path(sys.executable).with_name("areal-fn")
#: Megatron-LM's tracker file (``get_checkpoint_tracker_filename``)
TRACKER = "latest_checkpointed_iteration.txt"

CONFIGS: dict[str, dict[str, Any]] = {
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
    # layer 0 dense: per-layer keys
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
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
    # every layer sparse: stacked keys
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=90,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AREAL_FN_CHECKPOINT_KEY"}
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=300, env=env)


def _ok(*args: str) -> Any:
    proc = _run(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _error(*args: str) -> str:
    proc = _run(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("areal-fn: error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0].removeprefix("areal-fn: error: ")


def _here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``areal-fn ARGS`` run in this process (the same ``main`` the command runs)."""
    from areal_fn.cli import main

    capsys.readouterr()
    code = main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("torch_dist_cli")
    out = {}
    for family, cfg in CONFIGS.items():
        cfg = dict(cfg)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / family)
        out[family] = root / family
    return out


def _state(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize(
    ("family", "allocation", "keys"),
    [
        ("qwen2", "megatron:t2p2", "stacked"),
        ("qwen3_moe", "megatron:d2e2", "per-layer"),
        ("mixtral", "megatron:(attn:d2t2|ffn:d2t1e2)", "stacked"),
    ],
)
def test_torch_dist_round_trip_is_bitwise(
    saved: dict[str, Path], tmp_path: Path, family: str, allocation: str, keys: str
) -> None:
    src, ckpt, back = saved[family], tmp_path / "td", tmp_path / "back"
    doc = _ok("convert", str(src), allocation, str(ckpt), "--format", "torch_dist")
    vocab = CONFIGS[family]["vocab_size"]
    tp = 2 if "t2" in allocation else 1
    assert doc["schema"] == "areal-fn.convert/1" and doc["format"] == "torch_dist"
    assert doc["direction"] == "to-local" and doc["ranks"] == []
    assert doc["torch_dist"] == {
        "vocab_size_padded": -(-vocab // (128 * tp)) * 128 * tp,
        "layer_spec": "te",
        "layer_keys": keys,
    }
    assert {"config.json", "generation_config.json"} <= set(doc["carried"])
    names = {p.name for p in ckpt.iterdir()}
    assert names == {TRACKER, "release", *doc["carried"]}
    assert (ckpt / TRACKER).read_text() == "release"
    release = {p.name for p in (ckpt / "release").iterdir()}
    assert release == {".metadata", "__0_0.distcp", "common.pt", "metadata.json"}
    backend = json.loads((ckpt / "release" / "metadata.json").read_text())
    assert backend["sharded_backend"] == "torch_dist"
    assert torch.load(ckpt / "release" / "common.pt") == {"checkpoint_version": 3.0}
    back_doc = _ok("convert", str(ckpt), str(back), "--to-hf", "--trust-pickle")
    assert back_doc["format"] == "torch_dist" and back_doc["direction"] == "to-hf"
    assert back_doc["allocation"] is None and back_doc["torch_dist"] is None
    assert back_doc["carried"] == doc["carried"] and back_doc["not_carried"] == []
    a, b = _state(back), _state(src)
    assert list(a) == list(b)
    assert [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])] == []


def test_rank_files_stay_the_default_and_say_so(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _ok("convert", str(saved["qwen2"]), "megatron:t2", str(tmp_path / "local"))
    assert doc["format"] == "rank-files" and doc["torch_dist"] is None
    assert doc["ranks"] == [0, 1]
    # the rest in this process (the installed command is the same main)
    code, out, err = _here(
        capsys,
        "convert",
        str(saved["qwen2"]),
        "megatron:t2",
        str(tmp_path / "l2"),
        "--format",
        "rank-files",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["format"] == "rank-files"
    assert sorted(p.name for p in (tmp_path / "l2").glob("rank*")) == sorted(
        p.name for p in (tmp_path / "local").glob("rank*")
    )
    code, out, err = _here(
        capsys, "convert", str(tmp_path / "local"), str(tmp_path / "back"), "--to-hf", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["format"] == "rank-files"


def test_text_output_and_progress_summary(saved: dict[str, Path], tmp_path: Path) -> None:
    proc = _run(
        "convert",
        str(saved["qwen2"]),
        "megatron:t2",
        str(tmp_path / "td"),
        "--format",
        "torch_dist",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("converted ") and str(tmp_path / "td") in proc.stdout
    assert "to torch_dist" in proc.stderr and "tensors" in proc.stderr


def test_cli_errors(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # in this process (each subprocess start costs seconds); the command's own exit code,
    # one error line, no traceback
    def _error(*args: str) -> str:
        code, out, err = _here(capsys, *args)
        assert code == 2, out + err
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("areal-fn: error: ")]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0].removeprefix("areal-fn: error: ")

    def _ok(*args: str) -> Any:
        code, out, err = _here(capsys, *args, "--json")
        assert code == 0, err
        return json.loads(out)

    src = str(saved["qwen2"])
    out = tmp_path / "out"
    assert _error("convert", src, "megatron:t2", str(out), "--format", "torch-dist") == (
        "--format 'torch-dist' is not a checkpoint format; use rank-files (this library's "
        "per-rank files, the default) or torch_dist (Megatron-Core's dist checkpoint)"
    )
    assert _error("convert", src, "fsdp:d2", str(out), "--format", "torch_dist").startswith(
        "--format torch_dist writes Megatron-Core's own checkpoint, so it needs a megatron "
        "allocation, not fsdp:d2"
    )
    assert "needs a megatron allocation" in _error(
        "convert",
        src,
        "sglang:t2+megatron:t2",
        str(out),
        "--format",
        "torch_dist",
        "--component",
        "sglang",
    )
    assert "drop --rank" in _error(
        "convert", src, "megatron:t2", str(out), "--format", "torch_dist", "--rank", "0"
    )
    assert "it needs --format torch_dist" in _error(
        "convert", src, "megatron:t2", str(out), "--layer-spec", "local"
    )
    assert "tp=3 does not divide" in _error(
        "convert", src, "megatron:t3", str(out), "--format", "torch_dist"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left
    td = tmp_path / "td"
    _ok("convert", src, "megatron:t2", str(td), "--format", "torch_dist")
    assert _error("convert", src, "megatron:t2", str(td), "--format", "torch_dist") == (
        f"{td} already exists; pass --overwrite or choose another directory"
    )
    _ok("convert", src, "megatron:t2", str(td), "--format", "torch_dist", "--overwrite")
    pickle = _error("convert", str(td), str(out), "--to-hf")
    assert "pass --trust-pickle only for a checkpoint you saved" in pickle
    assert _error("convert", str(td), "megatron:t2", str(out), "--to-hf", "--trust-pickle") == (
        "a torch_dist checkpoint is not tied to an allocation (Megatron-Core loads it under any "
        "strategy); drop megatron:t2"
    )
    assert _error("convert", str(td), str(out), "--to-hf", "--format", "rank-files") == (
        f"{td} holds a Megatron-Core torch_dist checkpoint, not rank files; pass --format "
        "torch_dist or leave --format out"
    )
    other = str(saved["mixtral"])
    assert (
        _error("convert", str(td), str(out), "--to-hf", "--trust-pickle", "--model", other)
        == f"{td / 'config.json'} describes another model than --model; drop --model or the file"
    )
    (td / "config.json").unlink()
    assert _error("convert", str(td), str(out), "--to-hf", "--trust-pickle") == (
        f"{td} has no config.json; pass --model CONFIG"
    )
    missing = _error("convert", str(td), str(out), "--to-hf", "--trust-pickle", "--model", other)
    assert missing.startswith(f"{td / 'release'}: the Megatron checkpoint lacks")
    assert "mixtral" in missing
    (td / TRACKER).write_text("latest\n")
    assert _error("convert", str(td), str(out), "--to-hf", "--trust-pickle", "--model", src) == (
        f"{td / TRACKER} holds 'latest'; Megatron-LM's tracker holds the iteration to load or "
        "'release': write one of them, or pass the checkpoint directory itself"
    )
    (td / TRACKER).write_text("12")
    assert _error("convert", str(td), str(out), "--to-hf", "--trust-pickle", "--model", src) == (
        f"{td / TRACKER} names {td / 'iter_0000012'}, which holds no Megatron-Core dist "
        "checkpoint (no metadata.json); point the tracker at a checkpoint directory beside "
        "it, or pass the checkpoint directory itself"
    )
    (td / TRACKER).write_text("release")
    assert not out.exists()
    # --model stands in for the config Megatron's own checkpoints do not hold
    _ok("convert", str(td), str(out), "--to-hf", "--trust-pickle", "--model", src)
    a, b = _state(out), _state(saved["qwen2"])
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_to_hf_reads_the_flat_layout_and_the_iteration_a_tracker_names(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dist checkpoint itself (what --format torch_dist wrote before the tracker: its
    files and the HF files in one directory, an empty common state) and a tracker naming
    ``iter_0000007`` (as Megatron-LM's training saves): both convert back bitwise."""
    src, td = saved["qwen2"], tmp_path / "td"
    code, _, err = _here(
        capsys, "convert", str(src), "megatron:t2", str(td), "--format", "torch_dist"
    )
    assert code == 0, err
    flat = tmp_path / "flat"
    shutil.copytree(td / "release", flat)
    torch.save({}, flat / "common.pt")
    for p in td.iterdir():
        if p.is_file() and p.name != TRACKER:
            shutil.copy(p, flat / p.name)
    iters = tmp_path / "iters"
    shutil.copytree(td, iters)
    (iters / "release").rename(iters / "iter_0000007")
    (iters / TRACKER).write_text("7")
    for folder in (flat, iters):
        back = tmp_path / f"{folder.name}-hf"
        argv = ["convert", str(folder), str(back), "--to-hf", "--trust-pickle", "--json"]
        code, out, err = _here(capsys, *argv)
        assert code == 0, err
        doc = json.loads(out)
        assert doc["format"] == "torch_dist" and doc["not_carried"] == [], doc
        a, b = _state(back), _state(src)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_a_source_file_named_as_megatron_lms_own_is_refused(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(saved["qwen2"], src)
    (src / TRACKER).write_text("100")
    out = tmp_path / "out"
    code, _, err = _here(
        capsys, "convert", str(src), "megatron:t2", str(out), "--format", "torch_dist"
    )
    assert code == 2 and err.strip() == (
        f"areal-fn: error: {src / TRACKER}: --format torch_dist writes Megatron-LM's own "
        f"{TRACKER} in DST, so this file of SRC cannot be carried; move it out of {src}"
    )
    assert not out.exists()
