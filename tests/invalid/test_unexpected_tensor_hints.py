"""Unexpected checkpoint tensors that usually mean something: quantised weights (FP8
scales without a config that declares them, MXFP4 blocks) and multi-token-prediction
layers past ``num_hidden_layers``."""

import pytest
import torch

from areal_fn.errors import ConversionError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.convert import check_canonical
from tests.laws.test_mtp import TINY

_DS = TINY  # a tiny DeepSeek-V3 config (read without its MTP layer)


def _canonical(extra: list[str]) -> dict[str, torch.Tensor]:
    spec = model_from_hf_config(_DS)
    out = {t.name: torch.empty(t.shape) for t in spec.tensors}
    out.update({n: torch.empty(1) for n in extra})
    return out


CASES = [
    (
        "FP8 scales",
        ["model.layers.0.self_attn.q_a_proj.weight_scale_inv"],
        r"unexpected 1: \['model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv'\].*the "
        r"checkpoint holds FP8 weights \('weight_scale_inv'\) its config\.json does not "
        r"declare: block FP8 is read, dequantised, when config\.json's quantization_config says "
        r"quant_method fp8 \(put the config\.json published with the weights beside them\)$",
    ),
    (
        "an MTP layer",
        ["model.layers.2.enorm.weight", "model.layers.2.eh_proj.weight"],
        r"unexpected 2: .*; layers \['2'\] are beyond num_hidden_layers "
        r"\(multi-token-prediction layers, num_nextn_predict_layers, are not part of the model "
        r"transformers builds\): read the model with model_from_hf_config\(config, "
        r"mtp=True\) to hold them \(inference and megatron layouts carry them, fsdp refuses "
        r"them\), or leave them out with drop_mtp=True \(HfCheckpoint\.check, "
        r"convert_to_local, convert_to_torch_dist\)$",
    ),
]


@pytest.mark.parametrize(("what", "extra", "message"), CASES, ids=[c[0] for c in CASES])
def test_unexpected_tensors_get_their_reason(what: str, extra: list[str], message: str) -> None:
    spec = model_from_hf_config(_DS)
    with pytest.raises(ConversionError, match=message):
        check_canonical(_canonical(extra), spec.tensors)


_GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 16,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_undeclared_mxfp4_blocks_are_refused_saying_what_reads_them() -> None:
    """A published gpt-oss checkpoint's tensors (experts' weights as MXFP4 blocks and
    scales, ``[E, 2I, H/32, 16]`` uint8 and ``[E, 2I, H/32]``) checked without the config
    that declares them: the readers read them only when it does."""
    spec = model_from_hf_config(_GPT_OSS)
    held = {t.name: torch.empty(t.shape) for t in spec.tensors}
    for name in ("gate_up_proj", "down_proj"):
        del held[f"model.layers.0.mlp.experts.{name}"]
        held[f"model.layers.0.mlp.experts.{name}_blocks"] = torch.empty(2, 16, 2, 16)
        held[f"model.layers.0.mlp.experts.{name}_scales"] = torch.empty(2, 16, 2)
    with pytest.raises(
        ConversionError,
        match=r"missing 2: \['model\.layers\.0\.mlp\.experts\.gate_up_proj', .*unexpected 4: "
        r".*gate_up_proj_blocks.*; the checkpoint holds MXFP4 weights \('_blocks'/'_scales'\) "
        r"its config\.json does not declare: gpt-oss's MXFP4 experts are read, dequantised, "
        r"when config\.json's quantization_config says quant_method mxfp4 \(put the "
        r"config\.json published with the weights beside them\)$",
    ):
        check_canonical(held, spec.tensors)
