"""LoRA adapters on disk: a PEFT adapter directory, and a merged HF checkpoint.

:func:`write_peft_adapter` writes what ``peft.PeftModel.from_pretrained`` loads::

    out/adapter_config.json         peft_adapter_config(config)
    out/adapter_model.safetensors   the adapters by PEFT's names (float32 as given)

atomically like every writer of a directory here (a sibling temporary directory, every
file synced, then :func:`~areal_fn.runtime.replace_dir.replace_dir`); an existing
``out`` needs ``overwrite=True`` and may hold only those two files and PEFT's
``README.md``. :func:`read_peft_adapter` reads such a directory back (PEFT's own
included) and checks its tensors against the model. :func:`write_merged_hf` folds the
adapters into the base (:func:`~areal_fn.plans.lora_export.merge_lora`) and writes a
plain HF checkpoint with :func:`~areal_fn.runtime.hf.io.write_hf_checkpoint`.
"""

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from areal_fn.errors import ConversionError
from areal_fn.model.lora import LoraConfig, lora_tensors
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import check_canonical
from areal_fn.plans.lora_export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    lora_config_from_peft,
    merge_lora,
    peft_adapter_config,
)
from areal_fn.runtime.hf.files import HfFiles
from areal_fn.runtime.hf.io import write_hf_checkpoint
from areal_fn.runtime.replace_dir import check_overwrite, new_output_dir, replace_dir
from areal_fn.typecheck import beartype

__all__ = ["read_peft_adapter", "write_merged_hf", "write_peft_adapter"]

_OWNED = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md")


@beartype
def write_peft_adapter(
    path: "str | os.PathLike[str]",
    adapters: Mapping[str, torch.Tensor],
    *,
    model: ModelSpec,
    config: LoraConfig,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``adapters`` (exactly ``lora_tensors(model, config)``: PEFT's names and shapes)
    as a PEFT adapter directory at ``path``, atomically; returns ``path``."""
    check_canonical(adapters, lora_tensors(model, config))
    dest = Path(path)
    check_overwrite(
        dest,
        overwrite=overwrite,
        owned=lambda name: name in _OWNED,
        kind="PEFT adapter",
        error=ConversionError,
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_output_dir(dest)
    try:
        tensors = {
            s.name: adapters[s.name].detach().cpu().contiguous()
            for s in lora_tensors(model, config)
        }
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        body = peft_adapter_config(config, base_model_name_or_path=base_model_name_or_path)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


@beartype
def read_peft_adapter(
    path: "str | os.PathLike[str]", *, model: ModelSpec
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The configuration and adapter tensors of a PEFT adapter directory for ``model``.

    ``ConversionError`` when a file is missing or the tensors are not exactly those the
    configuration gives ``model``; ``LoraError`` for a configuration not modelled here.
    """
    folder = Path(path)
    missing = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / n).is_file()]
    if missing:
        raise ConversionError(
            f"{folder} is not a PEFT adapter directory: it lacks {missing}; pass the directory "
            "save_pretrained or write_peft_adapter wrote"
        )
    config = lora_config_from_peft(json.loads((folder / ADAPTER_CONFIG).read_text()))
    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    check_canonical(tensors, lora_tensors(model, config))
    return config, tensors


@beartype
def write_merged_hf(
    path: "str | os.PathLike[str]",
    base: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    *,
    model: ModelSpec,
    config: LoraConfig,
    hf: HfFiles | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model with its adapters merged (``W + (alpha / r) * B @ A``) as a plain HF
    checkpoint at ``path``, atomically. ``hf``: the base model's ``config.json`` and other
    files (else ``model.hf_config()``)."""
    merged = merge_lora(model, config, base, adapters)
    return write_hf_checkpoint(
        path,
        merged,
        config=None if hf is None else hf.config,
        model=model,
        files=() if hf is None else hf.files,
        overwrite=overwrite,
    )
