"""LoRA adapters against the real PEFT.

- Names, shapes and dtypes of :func:`lora_tensors` equal the keys of PEFT's saved
  ``adapter_model.safetensors`` (``get_peft_model`` on a tiny transformers model of
  each family, then ``save_pretrained``), per-module ranks (``rank_pattern``) included.
- Megatron's fused adapters compute what PEFT's separate ones do: PEFT's saved adapters
  converted into a Megatron layout's ``linear_qkv`` / ``linear_fc1`` adapters give, with
  the fused base weight, the outputs of PEFT's own q/k/v and gate/up modules.
"""

from pathlib import Path
from typing import Any

import peft
import pytest
import safetensors.torch
import torch
import transformers

from areal_fn.layouts.layout import LogicalTensor
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lora import with_lora
from areal_fn.model.lora import LoraConfig, default_targets, lora_tensors
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.convert import to_megatron
from tests.laws.test_lora import FAMILY_CONFIGS


def _build(cfg: dict[str, object]) -> tuple[ModelSpec, Any]:
    spec = model_from_hf_config(cfg)
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(spec.model_type, **rest)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype(spec.dtype))
    return spec, model


def _saved(model: Any, config: LoraConfig, tmp_path: Path) -> dict[str, torch.Tensor]:
    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        rank_pattern=dict(config.module_ranks),
        init_lora_weights=False,  # random B too, so that the outputs below differ from the base's
    )
    pm = peft.get_peft_model(model, peft_config)
    pm.save_pretrained(tmp_path)
    return safetensors.torch.load_file(str(tmp_path / "adapter_model.safetensors"))


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_names_shapes_dtypes_equal_peft(name: str, tmp_path: Path) -> None:
    spec, model = _build(FAMILY_CONFIGS[name])
    targets = default_targets(spec)
    ranks = {targets[-1]: 5} if len(targets) > 1 else {}
    config = LoraConfig(rank=3, alpha=6, target_modules=targets, module_ranks=ranks)
    saved = _saved(model, config, tmp_path)
    ours = {s.name: (s.shape, s.dtype) for s in lora_tensors(spec, config)}
    theirs = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in saved.items()}
    assert ours == theirs


def _member_rows(t: LogicalTensor) -> list[tuple[str, int, int, int]]:
    """(canonical, canonical row start, logical row start, rows) of each fusion piece."""
    return [
        (
            f.canonical,
            f.canonical_box.ranges[0][0],
            f.logical_box.ranges[0][0],
            f.logical_box.shape[0],
        )
        for f in t.fusion
    ]


def test_megatron_fused_adapters_compute_what_peft_computes(tmp_path: Path) -> None:
    spec, model = _build(FAMILY_CONFIGS["qwen2"])
    config = LoraConfig(rank=3, alpha=6, target_modules=default_targets(spec))
    canonical = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved = _saved(model, config, tmp_path)
    model.eval()
    source = {s.name: canonical[s.name] for s in spec.tensors} | saved
    layout = with_lora(layout_for(spec, "megatron:d1"), spec, config)
    states = to_megatron(source, layout, 0)
    x = torch.randn(spec.hidden_size, generator=torch.Generator().manual_seed(2))
    scale = config.alpha / config.rank
    layer = model.model.layers[0]  # PEFT wrapped its modules in place
    for stem, modules in (
        ("decoder.layers.0.self_attention.linear_qkv", ("q_proj", "k_proj", "v_proj")),
        ("decoder.layers.0.mlp.linear_fc1", ("gate_proj", "up_proj")),
    ):
        b_tensor = layout.tensor(stem + ".lora_B.weight")
        a_tensor = layout.tensor(stem + ".lora_A.weight")
        members = [f.canonical for f in a_tensor.fusion]
        ax = states[stem + ".lora_A.weight"] @ x
        y = states[stem + ".weight"] @ x
        b = states[stem + ".lora_B.weight"]
        r = config.rank
        for canonical, _, lo, n in _member_rows(b_tensor):
            i = members.index(canonical.replace("lora_B", "lora_A"))
            y[lo : lo + n] += scale * (b[lo : lo + n] @ ax[i * r : (i + 1) * r])
        # PEFT's own modules, placed by the base weight's fusion map
        block = layer.self_attn if "self_attention" in stem else layer.mlp
        with torch.no_grad():
            outs = {m: getattr(block, m)(x[None])[0] for m in modules}
        want = torch.empty_like(y)
        for canonical, c0, lo, n in _member_rows(layout.tensor(stem + ".weight")):
            module = canonical.split(".")[-2]
            want[lo : lo + n] = outs[module][c0 : c0 + n]
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(y, states[stem + ".weight"] @ x)
