"""Putting received model-format tensors into a live vLLM model.

Two paths:

- **reload** (CPU, and any platform whose kernels repack weights after loading):
  vLLM's layerwise reload (``initialize_layerwise_reload`` /
  ``finalize_layerwise_reload``) restores each layer's parameters in model format,
  and once a layer's parameters are loaded re-runs its post-load processing (the CPU
  GEMM repacking) and copies the result into the live storage. Each parameter is
  loaded with a loader that copies a tensor of the parameter's own shape: the
  received tensors already are this rank's part, cut by the plan, so vLLM's
  checkpoint loaders (which cut a rank's part out of a whole tensor) are not used.
  A parameter shared by several modules (a tied embedding and ``lm_head``) is loaded
  into each, so every module re-runs its processing.
- **in place** (GPU, unquantized: vLLM uses the loaded tensors as they are): the sync
  commits straight into the live parameters (:func:`live_tensors`).
"""

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["apply_full", "apply_reload", "live_tensors", "model_parameters"]


def model_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """vLLM's parameters by name (each shared parameter once, under its first name)."""
    return dict(model.named_parameters())


def live_tensors(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The live storage of the parameters ``names`` (the in-place path's destinations)."""
    params = model_parameters(model)
    return {n: params[n].data for n in names}


def _exact_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a tensor of the parameter's own shape (this rank's part, already cut)."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"received {tuple(loaded_weight.shape)} for a parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


@torch.no_grad()
def apply_reload(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], model_config: object
) -> None:
    """Load ``tensors`` (vLLM parameter name -> this rank's model-format tensor) through
    vLLM's layerwise reload; every named parameter must be given."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import (
        get_layerwise_info,
        make_online_process_loader,
    )

    params = model_parameters(model)
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise ValueError(
            f"the update does not match the model's parameters: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unknown {unknown[:4]}"
        )
    # every (module, attribute) holding each parameter, shared ones included
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, pname))
    targets = [
        (module, pname, tensors[n]) for n, p in params.items() for module, pname in owners[id(p)]
    ]
    # check every shape against the model format vLLM recorded, before anything changes
    # (a layer loaded in part would be processed in part)
    for module, pname, value in targets:
        # (a bias is never put on meta: vLLM loads it in place, so its live shape counts)
        recorded = get_layerwise_info(module).restore_metadata[0].get(pname)
        if recorded is None:
            recorded = module._parameters[pname]
        if recorded is None or tuple(recorded.shape) != tuple(value.shape):
            raise ValueError(
                f"{type(module).__name__}.{pname}: the update holds {tuple(value.shape)}, the "
                f"model format is {None if recorded is None else tuple(recorded.shape)}"
            )
    seen: set[tuple[int, str]] = set()
    initialize_layerwise_reload(model)
    saved: list[tuple[Any, object]] = []
    try:
        for module, pname, value in targets:
            if (id(module), pname) in seen:
                continue
            seen.add((id(module), pname))
            meta: Any = module._parameters[pname]
            # the restored (model-format) parameter's loader: ours, wrapped by vLLM's
            # layerwise wrapper so that vLLM counts, processes and copies as it does
            # (vLLM's parameter classes hold it behind a property: get and set it as one)
            saved.append((meta, getattr(meta, "weight_loader", None)))
            meta.weight_loader = _exact_loader
            meta.weight_loader = make_online_process_loader(module, pname)
            meta.weight_loader(meta, value)
    finally:
        finalize_layerwise_reload(model, model_config)
        _repack_moe_experts(model)
        for kept, loader in reversed(saved):  # vLLM keeps these records for its next reload
            if loader is None:
                with contextlib.suppress(AttributeError):
                    del kept.weight_loader
            elif kept.is_meta:
                kept.weight_loader = loader
            else:  # a live tensor (a bias): vLLM leaves its own loader there, unwrapped
                while getattr(loader, "__name__", "") == "online_process_loader":
                    loader = loader.__wrapped__  # type: ignore[attr-defined]
                kept.weight_loader = loader


@torch.no_grad()
def apply_full(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], model_config: object
) -> None:
    """Load whole canonical tensors (HF names) with vLLM's own loaders, through its
    layerwise reload: each loader cuts this rank's part (the ``full`` update)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        model.load_weights(iter(tensors.items()))  # type: ignore[operator]
    finally:
        finalize_layerwise_reload(model, model_config)
        _repack_moe_experts(model)


def _repack_moe_experts(model: torch.nn.Module) -> None:
    """Redo the experts' own setup vLLM 0.32 skips when MoE weights are reloaded.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' own
    ``process_weights_after_loading`` (the CPU build prepacks ``w13_weight`` and
    ``w2_weight`` into its grouped-GEMM layout there) only on the first load; on a reload
    it copies the weights in the kernel format and stops, so the CPU experts compute with
    unpacked weights (vLLM's own ``reload_weights`` of the checkpoint it loaded changes
    its outputs). CPU only: elsewhere the update writes in place, without a reload.
    """
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        weight = getattr(module, "w13_weight", None)
        if experts is None or not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
            continue
        experts.process_weights_after_loading(module)
