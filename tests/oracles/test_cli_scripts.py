"""The installed ``areal-fn`` for scripts and for people: ``--version``, ``--json`` on
``plan``, ``plan --suggest``, ``convert`` and ``checkpoint inspect``, whole names when
piped, ``--suggest`` assumptions and sizes, errors in flags, the KV cache of inference
components (checked against transformers' own cache).

Every command runs as a subprocess of the console script, stdout and stderr piped.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from areal_fn import ParallelDims, fsdp2_layout, model_from_hf_config, to_megatron
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.plans.memory.kv_cache import kv_cache
from areal_fn.runtime.hf.io import write_hf_checkpoint
from areal_fn.strategy.parse import parse_allocation

transformers = pytest.importorskip("transformers")

EXE = Path(sys.executable).with_name("areal-fn")
MODEL = model_from_hf_config(DEMO_CONFIG)


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}  # a narrow terminal must not fold piped tables
    env.pop("AREAL_FN_CHECKPOINT_KEY", None)
    return subprocess.run(
        [str(EXE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd or Path(__file__).parent,
        env=env,
    )


def _json(*args: str, cwd: Path | None = None) -> Any:
    proc = _run(*args, "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _error(*args: str, cwd: Path | None = None) -> str:
    proc = _run(*args, cwd=cwd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("areal-fn: error: ") and "Traceback" not in proc.stderr
    return lines[-1]


def test_version_is_the_installed_distribution() -> None:
    proc = _run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"areal-fn {importlib.metadata.version('areal-fn')}"


def test_piped_tables_keep_every_name_whole() -> None:
    proc = _run("plan", "Qwen2.5-7B", "megatron:t2", "--tensors", "12")
    assert proc.returncode == 0, proc.stderr
    layout = layout_for(
        model_from_hf_config("Qwen2.5-7B"), parse_allocation("megatron:t2").training
    )
    names = [t.name for t in layout.tensors[:12]]
    assert max(map(len, names)) > 40  # longer than a folded 80-column cell
    cells = {c.strip() for line in proc.stdout.splitlines() for c in line.split("│")}
    assert [n for n in names if n not in cells] == []


PLAN_KEYS = {"schema", "model", "allocation", "world_size", "components"}
COMPONENT_KEYS = {
    "label",
    "allocation",
    "backend",
    "first_rank",
    "last_rank",
    "layout",
    "meshes",
    "pipeline",
    "memory",
    "weights",
    "kv_cache",
    "fit",
    "notes",
}


def test_plan_json_has_the_documented_keys_and_global_ranks() -> None:
    doc = _json("plan", "demo", "sglang[roll]:d1t2+megatron[actor]:t2p2", "--tensors", "2")
    assert set(doc) == PLAN_KEYS and doc["schema"] == "areal-fn.plan/1"
    assert doc["allocation"] == "sglang[roll]:d1t2+megatron[actor]:d1p2t2"
    assert doc["world_size"] == 6
    roll, actor = doc["components"]
    assert set(roll) == COMPONENT_KEYS | {"tensors"} == set(actor)
    assert (roll["first_rank"], roll["last_rank"], actor["first_rank"]) == (0, 1, 2)
    assert [r["rank"] for r in roll["weights"]] == [0, 1]
    assert [r["rank"] for r in actor["memory"]["per_rank"]] == [2, 3, 4, 5]
    assert roll["memory"] is None and actor["weights"] is None and actor["kv_cache"] is None
    assert actor["pipeline"] is not None and actor["layout"] == "megatron"
    row = actor["memory"]["per_rank"][0]
    assert row["total"] == sum(
        row[k] for k in ("params", "grads", "optimizer", "activations", "buffers")
    )
    assert [t["name"] for t in roll["tensors"]] == [t.name for t in MODEL.tensors[:2]]


# -- the KV cache, against transformers' DynamicCache ----------------------------------

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=128,
    torch_dtype="float32",
)


def _hf_cache_bytes(batch: int, length: int) -> int:
    config = transformers.AutoConfig.for_model("qwen2", **TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.zeros(batch, length, dtype=torch.long), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


@pytest.mark.parametrize(("tp", "share"), [(1, 1), (2, 2), (4, 2)])
def test_kv_cache_is_what_transformers_caches(tmp_path: Path, tp: int, share: int) -> None:
    """One rank holds 1/tp of the heads, or one head replicated when tp exceeds them."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **TINY}))
    full = _hf_cache_bytes(batch=3, length=7)
    doc = _json("plan", str(tmp_path), f"sglang:d1t{tp}", "--context-len", "7", "--batch", "3")
    (comp,) = doc["components"]
    assert comp["kv_cache"]["max_bytes"] * share == full
    assert {r["kv_cache_bytes"] for r in comp["weights"]} == {full // share}
    assert all(r["total"] == r["weight_bytes"] + r["kv_cache_bytes"] for r in comp["weights"])


def test_kv_cache_of_pipeline_stages_and_of_multi_latent_attention() -> None:
    q7 = model_from_hf_config("Qwen2.5-7B")  # 28 layers, 4 KV heads of 128, bf16
    assert kv_cache(q7, "sglang:t1", context_len=1).max_bytes == 57_344  # 56 KiB a token
    staged = kv_cache(q7, "sglang:p3", context_len=1)
    assert staged.stage_layers == (10, 9, 9)
    # DeepSeek-V3's MLA caches kv_lora_rank + qk_rope_head_dim = 576 values per layer,
    # 61 layers: 70,272 bytes a token in bf16, on every tensor-parallel rank
    v3 = model_from_hf_config("DeepSeek-V3")
    assert kv_cache(v3, "sglang:t8", context_len=1).max_bytes == 576 * 61 * 2


# -- plan --suggest: assumptions, sizes, margin ------------------------------------------


def test_suggest_states_and_takes_its_assumptions() -> None:
    proc = _run("plan", "Qwen2.5-7B", "--suggest", "8", "--device-memory", "80GB", "--top", "1")
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--seq-len",
        "--micro-batch",
        "--global-batch",
        "--recompute",
        "--gpus-per-node",
        "--optimizer-offload",
        "--memory-margin",
    ):
        assert flag in proc.stdout, flag
    assert "CUDA context" in proc.stdout and "NCCL communication buffers" in proc.stdout
    flags = (
        *("--seq-len", "8192", "--micro-batch", "2", "--global-batch", "64", "--no-recompute"),
        *("--gpus-per-node", "4", "--optimizer-offload", "--memory-margin", "0.2"),
    )
    doc = _json("plan", "Qwen2.5-7B", "--suggest", "8", "--device-memory", "80GB", *flags)
    a = doc["assumptions"]
    assert (a["seq_len"], a["micro_batch"], a["global_batch"]) == (8192, 2, 64)
    assert (a["recompute"], a["gpus_per_node"], a["optimizer_offload"]) == (False, 4, True)
    assert a["usable_bytes"] == 64 * 10**9 and a["margin_bytes"] == 16 * 10**9
    assert doc["suggestions"] and all(s["optimizer"] == 0 for s in doc["suggestions"])
    assert all(s["peak_bytes"] <= a["usable_bytes"] for s in doc["suggestions"])
    on_device = _json("plan", "Qwen2.5-7B", "--suggest", "8", "--device-memory", "80GB")
    assert all(s["optimizer"] > 0 for s in on_device["suggestions"])


@pytest.mark.parametrize(("size", "nbytes"), [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30)])
def test_device_memory_units_are_read_exactly(size: str, nbytes: int) -> None:
    doc = _json("plan", "demo", "--suggest", "4", "--device-memory", size, "--top", "1")
    assert doc["device_memory_bytes"] == nbytes


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("80", "--device-memory '80' has no unit; write e.g. 80GB (80*10^9 bytes) or 80GiB"),
        ("80G", "--device-memory '80G': unit 'G' is not one of B, KB, MB, GB, TB"),
        ("0GB", "--device-memory '0GB' is not a positive size"),
    ],
)
def test_device_memory_without_a_clear_unit_is_refused(size: str, message: str) -> None:
    assert message in _error("plan", "demo", "--suggest", "4", "--device-memory", size)


# -- errors in the words of the command line --------------------------------------------


def _hf(path: Path, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {t.name: torch.randn(t.shape, generator=g) for t in MODEL.tensors}
    return write_hf_checkpoint(path, tensors, model=MODEL)


def test_errors_name_flags_not_python_arguments(tmp_path: Path) -> None:
    src = _hf(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    line = _error("convert", str(src), "megatron:t2", str(tmp_path / "out"))
    assert line.endswith("already exists; pass --overwrite or choose another directory"), line
    assert _run("convert", str(src), "megatron:t2", str(tmp_path / "local")).returncode == 0
    (tmp_path / "local" / "config.json").unlink()
    line = _error("convert", str(tmp_path / "local"), str(tmp_path / "back"), "--to-hf")
    assert line.endswith("has no config.json; pass --model CONFIG"), line
    ok = _run(
        "convert", str(tmp_path / "local"), "back", "--to-hf", "--model", "demo", cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    line = _error("plan", "Qwen2.5-72B", "--suggest", "2", "--device-memory", "16GB")
    assert line.endswith(
        "use more devices, bf16 state (--grad-dtype, --master-dtype, --adam-dtype), "
        "--optimizer-offload or --lora-rank R"
    ), line  # recompute is on and the micro-batch is 1 already: not offered
    assert "=True" not in line and "PrecisionPolicy" not in line
    lean = ["--no-recompute", "--seq-len", "4096", "--micro-batch", "2", "--optimizer-offload"]
    lean += ["--grad-dtype", "bf16", "--master-dtype", "none", "--adam-dtype", "bf16"]
    line = _error("plan", "Qwen2.5-72B", "--suggest", "2", "--device-memory", "16GB", *lean)
    assert line.endswith("use more devices, --recompute, a smaller --micro-batch or --lora-rank R")
    line = _error(
        "plan", "Qwen2.5-72B", "--suggest", "2", "--device-memory", "1GB", "--lora-rank", "8"
    )
    assert line.endswith("--optimizer-offload or a smaller --lora-rank"), line


# -- convert: one component, the recorded allocation, checksums, progress ---------------


def test_convert_refuses_a_mixed_allocation_unless_a_component_is_chosen(tmp_path: Path) -> None:
    src = _hf(tmp_path / "hf")
    mixed = "sglang:t2+megatron:t2p2"
    assert _error("convert", str(src), mixed, str(tmp_path / "out")) == (
        "areal-fn: error: sglang:d1t2+megatron:d1p2t2 has 2 components (sglang:d1t2, "
        "megatron:d1p2t2) and convert writes the files of one; pass --component megatron (or "
        "another), or give that component alone (megatron:d1p2t2)"
    )
    assert not (tmp_path / "out").exists()
    doc = _json("convert", str(src), mixed, str(tmp_path / "out"), "--component", "megatron")
    assert doc["allocation"] == "megatron:d1p2t2" and doc["ranks"] == [0, 1, 2, 3]
    meta = {
        p.name: safe_open(str(p), "pt").metadata()
        for p in sorted((tmp_path / "out").glob("rank*.safetensors"))
    }
    assert {m["allocation"] for m in meta.values()} == {"megatron:d1p2t2"}
    assert all(m["checksum"].startswith("blake3:") for m in meta.values())
    sglang = _json("convert", str(src), mixed, str(tmp_path / "sg"), "--component", "sglang")
    assert sglang["allocation"] == "sglang:d1t2" and sglang["ranks"] == [0, 1]


def test_to_hf_reads_the_recorded_allocation_and_verifies_checksums(tmp_path: Path) -> None:
    src = _hf(tmp_path / "hf")
    local, back = tmp_path / "local", tmp_path / "back"
    to_local = _run("convert", str(src), "megatron:t2p2", str(local))
    assert to_local.returncode == 0, to_local.stderr
    written = sum(
        len(safe_open(str(p), "pt").keys()) for p in sorted(local.glob("rank*.safetensors"))
    )
    assert (
        "to per-rank files" in to_local.stderr and f"{written}/{written} tensors" in to_local.stderr
    )
    doc = _json("convert", str(local), str(back), "--to-hf")
    assert doc["direction"] == "to-hf" and doc["allocation"] == "megatron:d1p2t2"
    assert doc["verified"] == [f"rank{r:05d}.safetensors" for r in range(4)]
    original = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    again = {k: v for f in sorted(back.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], original[k]) for k in original)
    proc = _run("convert", str(local), str(tmp_path / "b2"), "--to-hf")
    assert "to HF" in proc.stderr and f"{len(original)}/{len(original)} tensors" in proc.stderr
    # a mismatch is one short line
    line = _error("convert", str(local), "megatron:d2p2", str(tmp_path / "b3"), "--to-hf")
    assert line == (
        f"areal-fn: error: the rank files in {local} were written for megatron:d1p2t2, not "
        "megatron:d2p2; pass megatron:d1p2t2, or leave the allocation out (it is read from "
        "the files)"
    )
    # one flipped byte in a tensor's data is caught before anything is written
    f = local / "rank00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    line = _error("convert", str(local), str(tmp_path / "b4"), "--to-hf")
    assert line == (
        "areal-fn: error: rank00001.safetensors: the tensors do not match the checksum recorded "
        "when the file was written; the file was changed or damaged since: convert it again"
    )
    assert not (tmp_path / "b4").exists()


# -- checkpoint inspect --json -----------------------------------------------------------


def test_checkpoint_inspect_json(tmp_path: Path) -> None:
    from areal_fn.runtime.checkpoint.api import RankState, save_checkpoint

    layout = fsdp2_layout(MODEL, ParallelDims(dp=2, tp=2))
    canon = {t.name: torch.zeros(t.shape) for t in MODEL.tensors}
    states = {r: RankState(params=to_megatron(canon, layout, r)) for r in range(4)}
    save_checkpoint(
        tmp_path / "ck", layout=layout, states=states, model=MODEL, allocation="fsdp:d2t2", step=7
    )
    doc = _json("checkpoint", "inspect", str(tmp_path / "ck"), "--verify")
    assert doc["schema"] == "areal-fn.checkpoint-inspect/1"
    assert (doc["step"], doc["allocation"], doc["world_size"]) == (7, "fsdp:d2t2", 4)
    assert doc["verified"] is True and doc["keyed_digest"] == "none"
    config = transformers.AutoConfig.for_model(**DEMO_CONFIG)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert doc["num_params"] == sum(p.numel() for p in hf.parameters())
    assert sorted(t["name"] for t in doc["tensors"]) == sorted(hf.state_dict())
    folder = Path(doc["path"])
    assert doc["files"] and all(
        (folder / f["path"]).stat().st_size == f["size"] for f in doc["files"]
    )
    assert doc["bytes"] == sum(f["size"] for f in doc["files"])
    few = _json("checkpoint", "inspect", str(tmp_path / "ck"), "--tensors", "2")
    assert len(few["tensors"]) == 2 and few["verified"] is False
