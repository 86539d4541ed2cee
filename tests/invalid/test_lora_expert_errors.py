"""Refusals of LoRA adapters on routed experts (``LoraConfig.target_parameters``): the
configuration's own rules, a family without fused experts, the layouts that do not hold
them (the inference engines'), the Megatron engine under expert TP and the vLLM sync that
cannot serve them: one table of (call, error, regex). (Checkpoints of Megatron's
per-expert adapters save and load: tests/laws/test_strided_checkpoint_parts.py.)"""

from collections.abc import Callable

import pytest

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lora import with_lora
from areal_fn.model.lora import EXPERT_PARAMETERS, LoraConfig, LoraError, lora_tensors
from areal_fn.model.spec import model_from_hf_config

MOE: dict[str, object] = {
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
}
DENSE: dict[str, object] = {
    "model_type": "qwen3",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 40,
}
EXPERTS = LoraConfig(rank=2, target_modules=("q_proj",), target_parameters=EXPERT_PARAMETERS)


def _vllm_sync() -> object:
    from areal_fn.runtime.vllm.lora import VllmLoraSync

    return VllmLoraSync(object(), "/nonexistent", model_from_hf_config(MOE), EXPERTS)


def _megatron_etp() -> object:
    pytest.importorskip("megatron.core")
    from areal_fn.runtime.engines.megatron import MegatronEngine
    from areal_fn.strategy.parse import parse_allocation

    dims = parse_allocation("megatron:(attn:d4|ffn:d1t2e2)").training
    return MegatronEngine(model_from_hf_config(MOE), dims, lora=EXPERTS)


CASES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        "an unknown parameter",
        lambda: LoraConfig(rank=2, target_parameters=("mlp.experts.w1",)),
        LoraError,
        r"^LoraConfig\.target_parameters has 'mlp\.experts\.w1', which is not a parameter "
        r"LoRA targets here; use names from \['mlp\.experts\.gate_up_proj', "
        r"'mlp\.experts\.down_proj'\] \(a MoE layer's fused experts\)$",
    ),
    (
        "a string, not a sequence",
        lambda: LoraConfig(rank=2, target_parameters="mlp.experts.down_proj"),
        LoraError,
        r"^LoraConfig\.target_parameters='mlp\.experts\.down_proj' must be a sequence of "
        r"parameter names such as \('mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\)$",
    ),
    (
        "a parameter twice",
        lambda: LoraConfig(rank=2, target_parameters=EXPERT_PARAMETERS[:1] * 2),
        LoraError,
        r"^LoraConfig\.target_parameters=\('mlp\.experts\.gate_up_proj', "
        r"'mlp\.experts\.gate_up_proj'\) names a parameter twice; name each once$",
    ),
    (
        "dropout on expert adapters",
        lambda: LoraConfig(rank=2, dropout=0.1, target_parameters=EXPERT_PARAMETERS[1:]),
        LoraError,
        r"^LoraConfig\.dropout=0\.1 with target_parameters=\['mlp\.experts\.down_proj'\]: an "
        r"expert adapter folds into its weight, so no dropout can reach its input \(PEFT "
        r"refuses it too\); use dropout=0$",
    ),
    (
        "nothing targeted",
        lambda: LoraConfig(rank=2, target_modules=()),
        LoraError,
        r"^LoraConfig\.target_modules is empty \(and so is target_parameters\); name at least "
        r"one module$",
    ),
    (
        "a dense family",
        lambda: lora_tensors(model_from_hf_config(DENSE), EXPERTS),
        LoraError,
        r"^target_parameters names \['mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\]"
        r"; expert adapters are built where transformers fuses a MoE layer's per-expert "
        r"checkpoint weights into \[E, out, in\] parameters, and qwen3 has none of those: "
        r"drop target_parameters or use those names$",
    ),
    (
        "a MoE family's MLP modules",
        lambda: lora_tensors(
            model_from_hf_config(MOE), LoraConfig(rank=2, target_modules=("q_proj", "up_proj"))
        ),
        LoraError,
        r"^target_modules names \['up_proj'\] in qwen3_moe, a MoE family: PEFT makes them "
        r"adapters of the fused routed experts; target attention modules there \(\['q_proj', "
        r"'k_proj', 'v_proj', 'o_proj'\]\) and the routed experts with target_parameters="
        r"\['mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\]$",
    ),
    (
        "an inference layout",
        lambda: with_lora(
            layout_for(model_from_hf_config(MOE), "sglang:t2"), model_from_hf_config(MOE), EXPERTS
        ),
        LayoutError,
        r"^target_parameters=\['mlp\.experts\.gate_up_proj', 'mlp\.experts\.down_proj'\]: "
        r"adapters on routed experts are placed in the training engines' layouts \(fsdp2, "
        r"megatron\) only, and this layout is inference: drop target_parameters for it$",
    ),
    (
        "the Megatron engine under expert TP",
        _megatron_etp,
        LoraError,
        r"^LoraConfig\.target_parameters with etp=2: Megatron-Core's expert layers under "
        r"expert TP leave their output reduction to the token dispatcher, which the adapter "
        r"hooks do not follow \(measured: the loss off by 2e-3 from PEFT's\); use etp=1 for "
        r"expert adapters$",
    ),
    (
        "the vLLM adapter sync",
        _vllm_sync,
        LoraError,
        r"^LoraConfig\.target_parameters=\['mlp\.experts\.gate_up_proj', "
        r"'mlp\.experts\.down_proj'\]: adapters on routed experts are not synced into vLLM: "
        r"vLLM 0\.32's CPU build cannot serve LoRA on MoE experts \(PunicaWrapperCPU leaves "
        r"the fused-MoE LoRA ops unimplemented; .*GPU only\); sync the merged weights "
        r"\(merge_lora with VllmWeightSync\) or drop target_parameters$",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_refused(call: Callable[[], object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_an_engine_without_adapters_refuses_adapter_calls() -> None:
    from areal_fn.runtime.engines.common import trained_adapters

    with pytest.raises(
        LoraError,
        match=r"^this engine trains no LoRA adapters; build it with lora=LoraConfig\(\.\.\.\)$",
    ):
        trained_adapters(None)
