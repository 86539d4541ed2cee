"""LoRA adapters out of training: PEFT's ``adapter_config.json``, and adapters merged into the base.

:func:`peft_adapter_config` is the ``adapter_config.json`` PEFT reads for a
:class:`~areal_fn.model.lora.LoraConfig` (``peft_type`` ``LORA``, ``task_type``
``CAUSAL_LM``, ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``rank_pattern``, ``target_parameters``; no bias, no DoRA, no rsLoRA); :func:`lora_config_from_peft` reads one
back, refusing the PEFT features not modelled here (one ``LoraError`` line each).

:func:`merge_lora` folds the adapters into their base weights:
``W' = W + (alpha / r) * (B @ A)`` (per expert ``B_e @ A_e`` for a fused expert
parameter, its rows split over the expert's gate and up weights), computed in float32
and cast to ``W``'s dtype; every other tensor is returned as it is. The result is the model's plain canonical tensors,
what transformers loads without PEFT.
"""

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from areal_fn.model.lora import (
    EXPERT_PARAMETERS,
    MODULES,
    LoraConfig,
    LoraError,
    lora_expert_targets,
    lora_targets,
    lora_tensors,
)
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import check_canonical
from areal_fn.typecheck import beartype

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "lora_config_from_peft",
    "merge_lora",
    "peft_adapter_config",
]

#: PEFT's file names.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: Keys of a PEFT LoRA config whose value must be the one given here (else refused).
_PLAIN: dict[str, Any] = {
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "alpha_pattern": {},
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "exclude_modules": None,
    "trainable_token_indices": None,
    "layer_replication": None,
}


@beartype
def peft_adapter_config(
    config: LoraConfig, *, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``config`` as PEFT writes it (its fields that matter)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules),
        "rank_pattern": dict(config.module_ranks),
        "target_parameters": list(config.target_parameters) or None,
        "init_lora_weights": True,
        "inference_mode": True,
        **_PLAIN,
    }


def _refused(key: str, value: object, want: object) -> LoraError:
    return LoraError(
        f"adapter_config.json has {key}={value!r}; only {key}={want!r} is supported "
        "(plain LoRA on linear layers): export the adapter without it"
    )


def _module_order(targets: object) -> object:
    """PEFT's module set in :data:`~areal_fn.model.lora.MODULES` order (others after, in
    their order, for ``LoraConfig`` to refuse by name)."""
    if not isinstance(targets, list | tuple | set):
        return targets
    return tuple(m for m in MODULES if m in targets) + tuple(m for m in targets if m not in MODULES)


@beartype
def lora_config_from_peft(raw: Mapping[str, Any]) -> LoraConfig:
    """The :class:`~areal_fn.model.lora.LoraConfig` of a PEFT ``adapter_config.json`` (parsed).

    Target modules come in :data:`~areal_fn.model.lora.MODULES` order (PEFT keeps a set).
    ``LoraError`` for another ``peft_type``, ``target_modules`` given as a regular
    expression (a string), and any of bias, ``fan_in_fan_out``, rsLoRA, DoRA, per-module
    alphas, modules to save, layer selections.
    """
    if raw.get("peft_type") != "LORA":
        raise _refused("peft_type", raw.get("peft_type"), "LORA")
    for key, want in _PLAIN.items():
        value = raw.get(key, want)
        if value != want and not (want == {} and value is None):
            raise _refused(key, value, want)
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise LoraError(
            f"adapter_config.json has target_modules={targets!r}, a regular expression; "
            "list the module names instead (['q_proj', 'v_proj'])"
        )
    params = raw.get("target_parameters") or ()
    if isinstance(params, str) or not isinstance(params, list | tuple):
        raise LoraError(
            f"adapter_config.json has target_parameters={params!r}; expected a list of "
            f"parameter names ({list(EXPERT_PARAMETERS)})"
        )
    pattern = raw.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise LoraError(f"adapter_config.json has rank_pattern={pattern!r}; expected a mapping")
    return LoraConfig(
        rank=raw.get("r"),  # type: ignore[arg-type]  # LoraConfig checks it
        alpha=raw.get("lora_alpha", 8),  # PEFT's default
        dropout=raw.get("lora_dropout", 0.0),
        target_modules=_module_order(() if targets is None else targets),  # type: ignore[arg-type]
        module_ranks=pattern,  # type: ignore[arg-type]
        target_parameters=params,
    )


@beartype
def merge_lora(
    model: ModelSpec,
    config: LoraConfig,
    base: Mapping[str, Tensor],
    adapters: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """``base`` (the model's canonical tensors) with every adapter folded into its weight:
    ``W + (alpha / r) * (B @ A)`` in float32, cast to ``W``'s dtype. ``ConversionError``
    unless ``base`` holds exactly the model's tensors and ``adapters`` exactly the
    configuration's (PEFT's names and shapes)."""
    check_canonical(base, model.tensors)
    check_canonical(adapters, lora_tensors(model, config))
    out = dict(base)
    for t in lora_targets(model, config):
        w = base[t.base]
        a, b = adapters[t.lora_a].float(), adapters[t.lora_b].float()
        delta = (b @ a) * (float(config.alpha) / t.rank)
        out[t.base] = (w.float() + delta.to(w.device)).to(w.dtype)
    for x in lora_expert_targets(model, config):
        a = adapters[x.lora_a].float().reshape(x.experts, x.rank, x.in_features)
        b = adapters[x.lora_b].float().reshape(x.out_features, x.rank, x.experts)
        scale = float(config.alpha) / x.rank
        per_expert = len(x.parts) // x.experts
        for e in range(x.experts):
            delta = (b[:, :, e] @ a[e]) * scale  # expert e's [out, in]: its parts' rows
            row = 0
            for name in x.parts[e * per_expert : (e + 1) * per_expert]:
                w = base[name]
                d = delta[row : row + w.shape[0]]
                out[name] = (w.float() + d.to(w.device)).to(w.dtype)
                row += w.shape[0]
    return {s.name: out[s.name] for s in model.tensors}
