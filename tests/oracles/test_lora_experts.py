"""LoRA adapters on routed experts against PEFT's ``target_parameters`` and transformers.

For a tiny qwen3_moe and a tiny mixtral (transformers 5 holds their experts as fused
``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` and ``mlp.experts.down_proj``
``[E, H, I]``), with either or both fused parameters targeted:

- ``lora_tensors`` names and shapes every adapter as ``peft.get_peft_model`` saves it
  (``get_peft_model_state_dict``; the nested ``base_layer`` names included), and
  ``lora_config_from_peft`` reads PEFT's own ``adapter_config.json`` back to the config;
- ``inject_lora`` gives the transformers model PEFT's logits with the same adapters;
- ``merge_lora`` equals PEFT's ``merge_and_unload`` weights;
- an adapter checkpoint (``fsdp:d2`` adapter layout, saved offline): ``checkpoint
  inspect --json`` lists the expert adapters, ``convert --to-hf`` writes a directory
  ``peft.PeftModel.from_pretrained`` loads with the same logits, ``--merge BASE`` an HF
  checkpoint transformers loads with them; other FSDP2 strategies' adapter layouts load
  it (bitwise back); Megatron ``d2e2``'s per-expert adapters
  convert to and from its tensors bitwise, and loading it into them is refused.
"""

import json
from pathlib import Path
from typing import Any

import pytest

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from areal_fn.cli import main  # noqa: E402
from areal_fn.layouts.fsdp2 import fsdp2_layout  # noqa: E402
from areal_fn.layouts.layout_for import layout_for  # noqa: E402
from areal_fn.layouts.lora import adapter_layout  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.lora import (  # noqa: E402
    EXPERT_PARAMETERS,
    LoraConfig,
    lora_expert_targets,
    lora_param_count,
    lora_tensors,
)
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.convert import to_hf, to_megatron  # noqa: E402
from areal_fn.plans.lora_export import lora_config_from_peft, merge_lora  # noqa: E402
from areal_fn.runtime.checkpoint import (  # noqa: E402
    CheckpointReader,
    RankState,
    load_checkpoint,
    save_checkpoint,
)
from areal_fn.runtime.checkpoint.lora import lora_hf_files  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import build_hf_model  # noqa: E402
from areal_fn.runtime.engines.lora import inject_lora  # noqa: E402
from areal_fn.runtime.hf.io import write_hf_checkpoint  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 16,
        "intermediate_size": 24,
        "moe_intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 40,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "torch_dtype": "float32",
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 16,
        "intermediate_size": 20,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 44,
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "torch_dtype": "float32",
    },
}
TARGETS = [EXPERT_PARAMETERS, EXPERT_PARAMETERS[:1], EXPERT_PARAMETERS[1:]]
CASES = [(m, t) for m in CONFIGS for t in TARGETS]


def _config(targets: tuple[str, ...]) -> LoraConfig:
    return LoraConfig(rank=2, alpha=6.0, target_modules=("o_proj",), target_parameters=targets)


def _peft(spec: ModelSpec, config: LoraConfig, adapters: dict[str, torch.Tensor] | None) -> Any:
    model = peft.get_peft_model(
        build_hf_model(spec),
        peft.LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            target_modules=list(config.target_modules),
            target_parameters=list(config.target_parameters),
        ),
    )
    if adapters is not None:
        peft.set_peft_model_state_dict(model, adapters)
    return model


def _random(spec: ModelSpec, config: LoraConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) * 0.3 for s in lora_tensors(spec, config)}


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def _ids(spec: ModelSpec) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize(("family", "targets"), CASES)
def test_adapters_are_named_and_shaped_as_peft_saves_them(
    family: str, targets: tuple[str, ...], tmp_path: Path
) -> None:
    spec = model_from_hf_config(CONFIGS[family])
    config = _config(targets)
    ref = _peft(spec, config, None)
    saved = peft.get_peft_model_state_dict(ref)
    assert {s.name: s.shape for s in lora_tensors(spec, config)} == {
        k: tuple(v.shape) for k, v in saved.items()
    }
    assert lora_param_count(spec, config) == sum(v.numel() for v in saved.values())
    ref.save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert lora_config_from_peft(raw) == config


@pytest.mark.parametrize(("family", "targets"), CASES)
def test_injected_and_merged_adapters_compute_what_peft_computes(
    family: str, targets: tuple[str, ...]
) -> None:
    spec = model_from_hf_config(CONFIGS[family])
    config = _config(targets)
    adapters = _random(spec, config)
    ref = _peft(spec, config, adapters)
    ids = _ids(spec)
    want = _logits(ref, ids)
    model = build_hf_model(spec)
    inject_lora(model, spec, config)
    params = dict(model.named_parameters())
    local = {t.lora_a: t.base + "_lora_A" for t in lora_expert_targets(spec, config)}
    local |= {t.lora_b: t.base + "_lora_B" for t in lora_expert_targets(spec, config)}
    with torch.no_grad():
        for name, t in adapters.items():
            params[local.get(name, name.removeprefix("base_model.model."))].copy_(t)
    assert torch.equal(_logits(model, ids), want)
    base = hf_state_to_canonical(build_hf_model(spec).state_dict(), spec)
    merged = merge_lora(spec, config, base, adapters)
    peft_merged = hf_state_to_canonical(ref.merge_and_unload().state_dict(), spec)
    assert set(merged) == set(peft_merged)
    diff = max(float((merged[k] - peft_merged[k]).abs().max()) for k in merged)
    assert diff <= 1e-6, diff
    moved = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert moved and all(".experts." in k or "o_proj" in k for k in moved)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_experts")
    spec = model_from_hf_config(CONFIGS["qwen3_moe"])
    config = _config(EXPERT_PARAMETERS)
    adapters = _random(spec, config, seed=5)
    layout = adapter_layout(fsdp2_layout(spec, ParallelDims(dp=2)), spec, config)
    states = {r: RankState(params=to_megatron(adapters, layout, r)) for r in range(2)}
    ckpt = save_checkpoint(
        root / "ckpt",
        layout=layout,
        states=states,
        model=spec,
        allocation="fsdp:d2",
        step=1,
        save_rng=False,
        hf=lora_hf_files(spec, config),
    )
    base = write_hf_checkpoint(
        root / "base", hf_state_to_canonical(build_hf_model(spec).state_dict(), spec), model=spec
    )
    ids = _ids(spec)
    want = _logits(_peft(spec, config, adapters), ids)
    return dict(spec=spec, config=config, ckpt=ckpt, base=base, ids=ids, want=want)


def test_inspect_json_lists_the_expert_adapters(
    saved: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    assert main(["checkpoint", "inspect", str(saved["ckpt"]), "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    assert lora["target_parameters"] == list(EXPERT_PARAMETERS)
    experts = [a for a in lora["adapters"] if a["experts"] is not None]
    assert [(a["base"], a["module"], a["experts"]) for a in experts] == [
        (f"model.layers.{i}.{p}", p, 4) for i in range(2) for p in EXPERT_PARAMETERS
    ]
    first = experts[0]  # gate_up_proj of layer 0: PEFT's inner wrapper
    assert first["lora_A"] == {
        "name": "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight",
        "shape": [8, 16],
    }
    assert first["lora_B"]["shape"] == [24, 8]
    assert main(["checkpoint", "inspect", str(saved["ckpt"])]) == 0
    assert (
        "r=2, alpha=6.0, dropout=0.0, targets ['o_proj'], routed experts "
        "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']; export with"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("allocation", ["fsdp:d4", "fsdp:d2t2", "fsdp:d1"])
def test_the_checkpoint_loads_under_other_fsdp_strategies(
    saved: dict[str, Any], allocation: str
) -> None:
    """Offline, one process holding every rank: the ``fsdp:d2`` adapter checkpoint loads
    into another strategy's adapter layout and converts back to it bitwise."""
    spec, config = saved["spec"], saved["config"]
    layout = adapter_layout(layout_for(spec, allocation), spec, config)
    states = {
        r: RankState(params={lt.name: torch.zeros(lt.shape) for lt in layout.local_tensors(r)})
        for r in range(layout.world_size)
    }
    load_checkpoint(saved["ckpt"], layout=layout, states=states, restore_rng_state=False)
    back = to_hf({r: s.params for r, s in states.items()}, layout)
    reader = CheckpointReader(saved["ckpt"])
    assert set(back) == {t.name for t in reader.manifest.tensors}
    assert all(torch.equal(back[k], reader.read(k)) for k in back)


def test_megatron_expert_adapters_convert_and_load_from_checkpoints(
    saved: dict[str, Any],
) -> None:
    """Megatron ``d2e2``'s per-expert adapters hold expert ``e``'s part of PEFT's pair
    (rows of ``lora_A``, columns ``e::E`` of ``lora_B``): conversion is bitwise both ways,
    and the checkpoint loads into that layout bitwise (a strided region of one phase)."""
    spec, config = saved["spec"], saved["config"]
    layout = adapter_layout(layout_for(spec, "megatron:d2e2"), spec, config)
    reader = CheckpointReader(saved["ckpt"])
    adapters = {t.name: reader.read(t.name) for t in reader.manifest.tensors}
    ranks = {r: to_megatron(adapters, layout, r) for r in range(layout.world_size)}
    back = to_hf(ranks, layout)
    assert set(back) == set(adapters) and all(torch.equal(back[k], adapters[k]) for k in back)
    down_b = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"  # expert 1 of 4
    local = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.lora_B.weight"
    assert torch.equal(ranks[0][local], adapters[down_b][:, 1::4])
    states = {
        r: RankState(params={k: torch.full_like(v, float("nan")) for k, v in ranks[r].items()})
        for r in ranks
    }
    load_checkpoint(saved["ckpt"], layout=layout, states=states, restore_rng_state=False)
    for r, want in ranks.items():
        assert all(torch.equal(states[r].params[k], want[k]) for k in want), r


def test_convert_writes_peft_and_merged_expert_adapters(
    saved: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    ckpt, base = str(saved["ckpt"]), str(saved["base"])
    assert main(["convert", ckpt, str(adapter), "--to-hf"]) == 0
    assert main(["convert", ckpt, str(merged), "--to-hf", "--merge", base]) == 0
    capsys.readouterr()
    loaded = peft.PeftModel.from_pretrained(build_hf_model(saved["spec"]), str(adapter))
    assert torch.equal(_logits(loaded, saved["ids"]), saved["want"])
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(merged))
    diff = float((_logits(plain, saved["ids"]) - saved["want"]).abs().max())
    assert diff <= 1e-5, diff
