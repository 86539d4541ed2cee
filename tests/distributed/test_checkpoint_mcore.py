"""Megatron-Core's own checkpoints: imported into canonical space, exported for it to load.

One torchrun launch (2 ranks, gloo, CPU) of ``checkpoint_worker_mcore.py``: Megatron-Core
saves ``GPTModel`` s (dense under tp=2; MoE under ep=2: qwen3_moe stacked and per-layer,
glm4_moe, deepseek_v3, mixtral) with ``dist_checkpointing`` (``torch_dist``), we import
each (bitwise equal to the weights it held), export the canonical weights, and
Megatron-Core loads the export under other strategies (pp=2; other EP/ETP), bitwise
equal to ``to_megatron``. A checkpoint holding optimizer state is refused, or imported
without it on request.

Before the launch the installed ``areal-fn convert ... --format torch_dist`` writes
``transformers`` checkpoints (dense for ``megatron:t2``, MoE for ``megatron:d2e2``);
the worker finds the checkpoint in each OUT by Megatron-LM's ``--load`` rules (tracker,
directory, common state) and Megatron-Core loads it under that strategy and another
one, bitwise equal to ``to_megatron`` of the HF weights.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs megatron-core", allow_module_level=True)

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("checkpoint_mcore")]

WORKER = Path(__file__).with_name("checkpoint_worker_mcore.py")
REPO = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).with_name("areal-fn")

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 250,  # padded to 256 under tp=1 and tp=2 alike
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
#: (name, HF config, allocation, extra CLI flags, strategies Megatron loads it under)
CLI_CASES: list[tuple[str, dict[str, Any], str, list[str], list[str]]] = [
    ("qwen2", {**_BASE, "model_type": "qwen2"}, "megatron:t2", [], ["t2", "p2"]),
    (
        "qwen3_moe",
        {
            **_BASE,
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "megatron:d2e2",
        ["--layer-spec", "local"],
        ["e2", "t2-moe"],
    ),
]
LOAD_CHECKS = [
    f"cli {name}: megatron loads it under {s}" for name, _, _, _, loads in CLI_CASES for s in loads
]
MOE = ["qwen3_moe stacked", "qwen3_moe per-layer", "glm4_moe per-layer"]
MOE += ["deepseek_v3 per-layer", "mixtral stacked"]


def _hf(root: Path, name: str, cfg: dict[str, Any]) -> Path:
    import torch
    import transformers

    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / f"{name}-hf"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("checkpoint_mcore")
    cli = []
    for name, cfg, allocation, flags, loads in CLI_CASES:
        hf = _hf(out, name, cfg)
        ckpt = out / f"{name}-torch_dist"
        argv = [str(EXE), "convert", str(hf), allocation, str(ckpt), "--format", "torch_dist"]
        proc = subprocess.run(
            [*argv, *flags, "--json"], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        vocab = doc["torch_dist"]["vocab_size_padded"]
        cli.append({"name": name, "hf": str(hf), "ckpt": str(ckpt), "vocab": vocab, "loads": loads})
    (out / "cli.json").write_text(json.dumps(cli))
    run_torchrun(
        WORKER,
        ["--out", str(out), "--cli", str(out / "cli.json")],
        nproc=2,
        timeout_s=900,
        cwd=REPO,
    )
    return [json.loads((out / f"rank{r}.json").read_text())["checks"] for r in range(2)]


@pytest.mark.parametrize("case", ["dense t2", *(f"{m} e2" for m in MOE)])
def test_import_of_a_megatron_checkpoint_is_bitwise(checks, case):
    name, saves = case.rsplit(" ", 1)
    key = f"{name}: import of a Megatron {saves} checkpoint"
    assert checks[0].get(key) == "", (key, checks[0])


LOADS = [("dense", "p2"), ("qwen3_moe stacked", "t2-moe"), ("qwen3_moe stacked", "t2e2")]
LOADS += [("qwen3_moe per-layer", "t2-moe"), ("qwen3_moe per-layer", "p2")]
LOADS += [("glm4_moe per-layer", "t2e2"), ("deepseek_v3 per-layer", "t2-moe")]
LOADS += [("mixtral stacked", "t2e2")]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("name", "strategy"), LOADS)
def test_megatron_loads_our_export_bitwise(checks, rank, name, strategy):
    key = f"{name}: megatron loads the export under {strategy}"
    assert checks[rank].get(key) == "", (key, checks[rank])


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("key", LOAD_CHECKS)
def test_megatron_loads_the_cli_output_under_its_strategy_and_another(checks, rank, key):
    assert checks[rank].get(key) == "", (key, checks[rank])


@pytest.mark.parametrize("key", ["optimizer state refused", "optimizer state dropped on request"])
def test_optimizer_state_is_refused_or_dropped_on_request(checks, key):
    assert checks[0].get(key) == "", (key, checks[0])
