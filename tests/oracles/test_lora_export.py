"""LoRA export against the real PEFT and transformers.

- :func:`write_peft_adapter` writes a directory ``peft.PeftModel.from_pretrained`` loads,
  whose logits equal PEFT's own model holding the same adapters and our
  :class:`~areal_fn.runtime.engines.lora.LoraLinear` model's; PEFT's own
  ``save_pretrained`` output reads back (:func:`read_peft_adapter`) to the same
  configuration and bitwise the same tensors.
- :func:`write_merged_hf` writes a plain HF checkpoint that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads with the logits of the PEFT
  model, its weights those of PEFT's ``merge_and_unload``.
- The refusals: PEFT features not modelled, tensors that do not match, an existing
  directory with other files.
"""

import json
from pathlib import Path
from typing import Any

import pytest

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from areal_fn.errors import ConversionError  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.lora import LoraConfig, LoraError, lora_tensors  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.lora_export import lora_config_from_peft, peft_adapter_config  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import build_hf_model  # noqa: E402
from areal_fn.runtime.engines.lora import inject_lora  # noqa: E402
from areal_fn.runtime.hf.peft_io import (  # noqa: E402
    read_peft_adapter,
    write_merged_hf,
    write_peft_adapter,
)

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 50,
    "torch_dtype": "float32",
}
LORA = LoraConfig(
    rank=4,
    alpha=12.0,
    target_modules=("q_proj", "v_proj", "o_proj", "down_proj"),
    module_ranks=(("down_proj", 2),),
)


def _peft_config(config: LoraConfig) -> Any:
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        rank_pattern=dict(config.module_ranks),
    )


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    spec = model_from_hf_config(CONFIG)
    g = torch.Generator().manual_seed(3)
    adapters = {s.name: torch.randn(s.shape, generator=g) * 0.3 for s in lora_tensors(spec, LORA)}
    ref = peft.get_peft_model(build_hf_model(spec), _peft_config(LORA))
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, t in adapters.items():
            stem, ab = name.rsplit(".lora_", 1)
            params[f"{stem}.lora_{ab[0]}.default.weight"].copy_(t)
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        logits = ref(input_ids=ids).logits
    return dict(spec=spec, adapters=adapters, ref=ref, ids=ids, logits=logits)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def test_peft_loads_our_adapter_directory(setup: dict[str, Any], tmp_path: Path) -> None:
    spec: ModelSpec = setup["spec"]
    out = write_peft_adapter(tmp_path / "adapter", setup["adapters"], model=spec, config=LORA)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = peft.PeftModel.from_pretrained(build_hf_model(spec), str(out))
    assert torch.equal(_logits(loaded, setup["ids"]), setup["logits"])
    ours = build_hf_model(spec)
    inject_lora(ours, spec, LORA)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, t in setup["adapters"].items():
            params[name.removeprefix("base_model.model.")].copy_(t)
    assert torch.equal(_logits(ours, setup["ids"]), setup["logits"])
    # PEFT's reading of our config is our config
    read = peft.LoraConfig.from_pretrained(str(out))
    assert read.r == LORA.rank and read.lora_alpha == LORA.alpha
    assert set(read.target_modules) == set(LORA.target_modules)
    assert read.rank_pattern == {"down_proj": 2}


def test_peft_save_pretrained_reads_back(setup: dict[str, Any], tmp_path: Path) -> None:
    setup["ref"].save_pretrained(str(tmp_path / "peft"))
    config, tensors = read_peft_adapter(tmp_path / "peft", model=setup["spec"])
    assert config == LORA
    assert set(tensors) == set(setup["adapters"])
    assert all(torch.equal(tensors[k], v) for k, v in setup["adapters"].items())


def test_transformers_loads_the_merged_checkpoint(setup: dict[str, Any], tmp_path: Path) -> None:
    spec: ModelSpec = setup["spec"]
    base = hf_state_to_canonical(build_hf_model(spec).state_dict(), spec)
    out = write_merged_hf(tmp_path / "merged", base, setup["adapters"], model=spec, config=LORA)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    diff = (_logits(merged, setup["ids"]) - setup["logits"]).abs().max()
    assert float(diff) <= 1e-5, float(diff)  # observed 2.7e-7
    # PEFT's own merge of a copy gives the same weights
    ref = peft.get_peft_model(build_hf_model(spec), _peft_config(LORA))
    peft.set_peft_model_state_dict(ref, setup["adapters"])
    want = ref.merge_and_unload().state_dict()
    got = merged.state_dict()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-6, worst  # observed 0.0 (bitwise) in float32
    moved = max(float((got[k] - base[k]).abs().max()) for k in base if k in got)
    assert moved > 1e-2, "the merge changed nothing"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("use_dora", True, r"^adapter_config\.json has use_dora=True; only use_dora=False is "),
        ("use_rslora", True, r"^adapter_config\.json has use_rslora=True; only use_rslora=False"),
        ("bias", "all", r"^adapter_config\.json has bias='all'; only bias='none' is supported "),
        ("alpha_pattern", {"q_proj": 4}, r"has alpha_pattern=\{'q_proj': 4\}; only alpha_pat"),
        ("peft_type", "IA3", r"^adapter_config\.json has peft_type='IA3'; only peft_type='LORA'"),
        ("target_modules", ".*q_proj", r"target_modules='\.\*q_proj', a regular expression; "),
        ("r", 0, r"^LoraConfig\.rank=0 must be an int >= 1"),
        (
            "target_parameters",
            "mlp.experts.gate_up_proj",
            r"^adapter_config\.json has target_parameters='mlp\.experts\.gate_up_proj'; expected "
            r"a list of parameter names \(\['mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\]\)$",
        ),
        (
            "target_parameters",
            ["experts.w1"],
            r"^LoraConfig\.target_parameters has 'experts\.w1', which is not a parameter LoRA "
            r"targets here; use names from \['mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\]",
        ),
    ],
)
def test_peft_configs_not_modelled_are_refused(key: str, value: object, message: str) -> None:
    raw = peft_adapter_config(LORA) | {key: value}
    with pytest.raises(LoraError, match=message):
        lora_config_from_peft(raw)


def test_our_config_reads_back() -> None:
    assert lora_config_from_peft(json.loads(json.dumps(peft_adapter_config(LORA)))) == LORA


def test_adapters_that_do_not_match_are_refused(setup: dict[str, Any], tmp_path: Path) -> None:
    spec: ModelSpec = setup["spec"]
    wrong = dict(setup["adapters"])
    name = next(iter(wrong))
    wrong[name] = torch.zeros(3, 3)
    with pytest.raises(ConversionError, match=r"mis-shaped 1: .*lora_A\.weight: got \(3, 3\)"):
        write_peft_adapter(tmp_path / "a", wrong, model=spec, config=LORA)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConversionError, match=r"is not a PEFT adapter directory: it lacks "):
        read_peft_adapter(tmp_path, model=spec)


def test_an_existing_directory_is_replaced_only_when_asked(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    spec: ModelSpec = setup["spec"]
    dest = tmp_path / "a"
    write_peft_adapter(dest, setup["adapters"], model=spec, config=LORA)
    with pytest.raises(ConversionError, match=r"already exists; pass overwrite=True"):
        write_peft_adapter(dest, setup["adapters"], model=spec, config=LORA)
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match=r"holds 1 entry the new PEFT adapter would not "):
        write_peft_adapter(dest, setup["adapters"], model=spec, config=LORA, overwrite=True)
    (dest / "notes.txt").unlink()
    doubled = {k: 2 * v for k, v in setup["adapters"].items()}
    write_peft_adapter(dest, doubled, model=spec, config=LORA, overwrite=True)
    _, back = read_peft_adapter(dest, model=spec)
    assert all(torch.equal(back[k], v) for k, v in doubled.items())
