"""The installed ``areal-fn`` command: ``models`` lists the embedded configs (parameter
totals checked against transformers' own models), every command takes their names in
any case, and the new allocation spellings (HSDP, whitespace) work from the shell."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

EXE = Path(sys.executable).with_name("areal-fn")
SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(EXE), *args], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent
    )


def _transformers_params(name: str) -> int:
    cfg = json.loads((SPECS / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_models_lists_every_embedded_config_with_its_parameters() -> None:
    proc = _run("models")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == [
        "name",
        "model_type",
        "parameters",
        "active",
        "layers",
        "hidden",
        "heads/kv",
        "experts",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == ["demo", *sorted(p.stem for p in SPECS.glob("*.json"))]
    for name in ("Qwen2.5-0.5B", "Qwen2.5-7B", "Llama-3.1-8B"):
        assert rows[name][2] == f"{_transformers_params(name):,}", name
        assert rows[name][3] == "-" and rows[name][7] == "-"
    assert rows["Qwen2.5-7B"][1:2] + rows["Qwen2.5-7B"][4:7] == ["qwen2", "28", "3584", "28/4"]
    moe = rows["Qwen3-30B-A3B"]
    assert moe[2] == f"{_transformers_params('Qwen3-30B-A3B'):,}"
    assert moe[7:] == ["128x", "top-8"]


@pytest.mark.parametrize("name", ["qwen2.5-7b", "Qwen/Qwen2.5-7B", "QWEN2.5-7B"])
def test_plan_takes_a_name_in_any_case(name: str) -> None:
    proc = _run("plan", name, "fsdp : d2x4")
    assert proc.returncode == 0, proc.stderr
    assert "allocation fsdp:d2x4 on 8 ranks" in proc.stdout
    assert "meshes Mesh(dp_replicate=2, dp_shard=4)" in proc.stdout


def test_plan_takes_the_hybrid_form_without_parentheses() -> None:
    proc = _run("plan", "qwen3-30b-a3b", "megatron:attn:d2t2|ffn:e4")
    assert proc.returncode == 0, proc.stderr
    assert "allocation megatron:d2t2e4 on 4 ranks" in proc.stdout


def test_an_unknown_name_is_one_line_with_the_close_matches() -> None:
    proc = _run("plan", "Qwen2.5-7B-Instruct", "fsdp:d2")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (
        "areal-fn: error: no config file at 'Qwen2.5-7B-Instruct' and no embedded model of that "
        "name; did you mean 'Qwen2.5-7B' or 'Qwen2.5-72B' or 'Qwen3-Next-80B-A3B-Instruct'? pass "
        "a config.json, a directory "
        "holding one, or a name that `areal-fn models` lists"
    )
