"""``areal-fn`` on LoRA adapter checkpoints, against PEFT and transformers.

An adapter checkpoint (an ``fsdp:d2`` adapter layout saved offline by one process
holding both ranks, ``hf=lora_hf_files``): ``checkpoint inspect`` names its LoRA
configuration and lists its adapter tensors; ``convert CKPT DST --to-hf`` writes a PEFT
adapter directory ``peft.PeftModel.from_pretrained`` loads with the adapters' logits;
``--merge BASE`` writes an HF checkpoint transformers loads with the same logits; the
flags that do not apply are refused in one line.
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from areal_fn.cli import main  # noqa: E402
from areal_fn.layouts.fsdp2 import fsdp2_layout  # noqa: E402
from areal_fn.layouts.lora import adapter_layout  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.lora import LoraConfig, lora_tensors  # noqa: E402
from areal_fn.model.spec import model_from_hf_config  # noqa: E402
from areal_fn.plans.convert import to_megatron  # noqa: E402
from areal_fn.runtime.checkpoint import RankState, save_checkpoint  # noqa: E402
from areal_fn.runtime.checkpoint.lora import lora_hf_files  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import build_hf_model  # noqa: E402
from areal_fn.runtime.hf.io import write_hf_checkpoint  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 40,
    "torch_dtype": "float32",
}
LORA = LoraConfig(rank=2, alpha=6.0, target_modules=("q_proj", "v_proj", "up_proj"))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_cli")
    spec = model_from_hf_config(CONFIG)
    g = torch.Generator().manual_seed(5)
    adapters = {s.name: torch.randn(s.shape, generator=g) * 0.3 for s in lora_tensors(spec, LORA)}
    layout = adapter_layout(fsdp2_layout(spec, ParallelDims(dp=2)), spec, LORA)
    states = {r: RankState(params=to_megatron(adapters, layout, r)) for r in range(2)}
    ckpt = save_checkpoint(
        root / "ckpt",
        layout=layout,
        states=states,
        model=spec,
        allocation="fsdp:d2",
        step=3,
        save_rng=False,
        hf=lora_hf_files(spec, LORA),
    )
    base = write_hf_checkpoint(
        root / "base", hf_state_to_canonical(build_hf_model(spec).state_dict(), spec), model=spec
    )
    ref = peft.get_peft_model(
        build_hf_model(spec),
        peft.LoraConfig(
            r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules)
        ),
    )
    peft.set_peft_model_state_dict(ref, adapters)
    ids = torch.randint(0, spec.vocab_size, (2, 10), generator=g)
    with torch.no_grad():
        logits = ref(input_ids=ids).logits
    saved = peft.get_peft_model_state_dict(ref)  # PEFT's names and shapes, as it saves them
    return dict(
        root=root,
        spec=spec,
        adapters=adapters,
        ckpt=ckpt,
        base=base,
        ids=ids,
        logits=logits,
        peft_shapes={k: list(v.shape) for k, v in saved.items()},
    )


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def test_inspect_names_the_adapters(made: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    assert main(["checkpoint", "inspect", str(made["ckpt"]), "--tensors", "50"]) == 0
    out = capsys.readouterr().out
    assert (
        "  LoRA adapters of a frozen base (hf/adapter_config.json): r=2, alpha=6.0, "
        "dropout=0.0, targets ['q_proj', 'v_proj', 'up_proj']; export with convert DIR DST "
        "--to-hf (PEFT) or --to-hf --merge BASE"
    ) in out.splitlines()
    for name in made["adapters"]:
        assert f"  {name}" in out


def test_inspect_json_has_the_lora_field(
    made: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    assert main(["checkpoint", "inspect", str(made["ckpt"]), "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    adapters = lora.pop("adapters")
    assert lora == {
        "config": "hf/adapter_config.json",
        "rank": 2,
        "alpha": 6.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj", "up_proj"],
        "module_ranks": {},
        "target_parameters": [],
    }
    shapes = {a[k]["name"]: a[k]["shape"] for a in adapters for k in ("lora_A", "lora_B")}
    assert shapes == made["peft_shapes"]  # every adapter PEFT saves, by its name and shape
    for a in adapters:
        assert a["lora_A"]["name"] == "base_model.model." + a["base"].replace(
            ".weight", ".lora_A.weight"
        )
        assert a["base"].split(".")[-2] == a["module"] and a["rank"] == 2
        assert a["experts"] is None


def test_convert_writes_peft_and_merged(
    made: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["convert", str(made["ckpt"]), str(adapter), "--to-hf"]) == 0
    assert (
        main(["convert", str(made["ckpt"]), str(merged), "--to-hf", "--merge", str(made["base"])])
        == 0
    )
    out = capsys.readouterr().out
    assert "PEFT adapter (adapter_config.json, adapter_model.safetensors)" in out
    loaded = peft.PeftModel.from_pretrained(build_hf_model(made["spec"]), str(adapter))
    assert torch.equal(_logits(loaded, made["ids"]), made["logits"])
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(merged))
    diff = float((_logits(plain, made["ids"]) - made["logits"]).abs().max())
    assert diff <= 1e-5, diff


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["convert", "{ckpt}", "fsdp:d2", "{x}", "--to-hf"],
            r" is a LoRA adapter checkpoint; --to-hf writes its adapters \(PEFT's format, or "
            r"merged with --merge BASE\) and takes no ALLOCATION: drop it$",
        ),
        (["convert", "{ckpt}", "{x}", "--to-hf", "--rank", "0"], r" and takes no --rank: drop it$"),
        (
            ["convert", "{base}", "fsdp:d2", "{x}", "--merge", "{base}"],
            r"error: --merge BASE merges a LoRA adapter checkpoint; .*base is not one \(or "
            r"--to-hf is missing\): pass an adapter checkpoint with --to-hf, or drop --merge$",
        ),
        (
            ["checkpoint", "export-hf", "{ckpt}", "{x}"],
            r" holds LoRA adapters, not a model; write them with areal-fn convert .* DST --to-hf",
        ),
    ],
)
def test_what_does_not_apply_is_refused(
    made: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    argv: list[str],
    message: str,
) -> None:
    paths = {"ckpt": str(made["ckpt"]), "base": str(made["base"]), "x": str(tmp_path / "x")}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fn: error: ") and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "x").exists()
