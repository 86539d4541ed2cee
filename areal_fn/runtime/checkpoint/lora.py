"""LoRA adapter checkpoints: the adapters and their optimizer state, like any tensors.

An adapter checkpoint is an ordinary checkpoint of an engine's ``adapter_layout``
(:func:`~areal_fn.layouts.lora.adapter_layout`): its canonical tensors are the adapters
by PEFT's names, its optimizer state theirs, so any strategy loads what any other saved
(FSDP2's adapters or Megatron's fused ones alike). Saved with ``hf=lora_hf_files(model,
config)``, its ``hf/`` folder holds the base model's ``config.json`` and PEFT's
``adapter_config.json``, which is what makes it an adapter checkpoint to the readers
below::

    save_checkpoint(root, layout=engine.adapter_layout,
                    states={rank: RankState(params=engine.adapter_local_state(),
                                            optim=engine.optimizer_local_state())},
                    model=spec, allocation="fsdp:d2t2", step=step, optimizer="adamw",
                    hf=lora_hf_files(spec, engine.lora))
    export_peft(root, "adapter/")                    # peft.PeftModel.from_pretrained reads it
    export_merged(root, "base_model/", "merged/")    # transformers reads it

:func:`checkpoint_lora` says whether a checkpoint holds adapters (and their
configuration); :func:`export_peft` writes its adapters as a PEFT adapter directory,
:func:`export_merged` merges them into a base HF checkpoint and writes a plain one.
"""

import json
import os
from pathlib import Path

from areal_fn.errors import CheckpointError
from areal_fn.model.lora import LoraConfig, lora_tensors
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.checkpoint.manifest import check_model
from areal_fn.plans.lora_export import ADAPTER_CONFIG, lora_config_from_peft, peft_adapter_config
from areal_fn.runtime.checkpoint.inspect import CheckpointReader
from areal_fn.runtime.hf.files import HF_DIR, HfFiles, checkpoint_hf_files
from areal_fn.runtime.hf.io import HfCheckpoint
from areal_fn.runtime.hf.peft_io import write_merged_hf, write_peft_adapter
from areal_fn.typecheck import beartype

__all__ = [
    "checkpoint_lora",
    "export_merged",
    "export_peft",
    "is_adapter_checkpoint",
    "lora_hf_files",
]


@beartype
def lora_hf_files(model: ModelSpec, config: LoraConfig, *, hf: HfFiles | None = None) -> HfFiles:
    """``hf`` (default: ``model.hf_config()`` alone) with PEFT's ``adapter_config.json`` of
    ``config`` beside it: the ``hf=`` of an adapter checkpoint."""
    base = hf if hf is not None else HfFiles.of_config(model.hf_config())
    text = json.dumps(peft_adapter_config(config), indent=2, sort_keys=True) + "\n"
    files = [(n, b) for n, b in base.files if n != ADAPTER_CONFIG]
    return HfFiles(config=base.config, files=[*files, (ADAPTER_CONFIG, text.encode())])


@beartype
def is_adapter_checkpoint(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` is a checkpoint (or a root with ``latest``) whose ``hf/`` holds
    PEFT's ``adapter_config.json`` (nothing but the manifest is read)."""
    from areal_fn.runtime.checkpoint.files import read_manifest, resolve_checkpoint

    try:
        folder = resolve_checkpoint(path)
        manifest = read_manifest(folder)
    except CheckpointError:
        return False
    return any(f.path == f"{HF_DIR}/{ADAPTER_CONFIG}" for f in manifest.files)


@beartype
def checkpoint_lora(reader: CheckpointReader) -> tuple[ModelSpec, LoraConfig] | None:
    """The base model and LoRA configuration of an adapter checkpoint (None: not one).

    ``CheckpointError`` when its ``hf/adapter_config.json`` does not describe exactly the
    adapter tensors it holds."""
    hf = checkpoint_hf_files(reader.path, reader.manifest)
    raw = None if hf is None else dict(hf.files).get(ADAPTER_CONFIG)
    if hf is None or raw is None:
        return None
    model = model_from_hf_config(hf.config_dict)
    config = lora_config_from_peft(json.loads(raw))
    check_model(reader.manifest, lora_tensors(model, config), source=str(reader.path))
    return model, config


def _adapter_checkpoint(
    path: "str | os.PathLike[str]", hmac_key: bytes | None
) -> tuple[CheckpointReader, ModelSpec, LoraConfig]:
    reader = CheckpointReader(path, hmac_key=hmac_key)  # every checksum verified
    found = checkpoint_lora(reader)
    if found is None:
        raise CheckpointError(
            f"{reader.path} is not a LoRA adapter checkpoint (no hf/{ADAPTER_CONFIG}); save "
            "the adapters with hf=lora_hf_files(model, config), or export a full model with "
            "export_hf"
        )
    return reader, *found


@beartype
def export_peft(
    path: "str | os.PathLike[str]",
    dest: "str | os.PathLike[str]",
    *,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
    hmac_key: bytes | None = None,
) -> Path:
    """Write an adapter checkpoint's adapters as a PEFT adapter directory at ``dest``."""
    reader, model, config = _adapter_checkpoint(path, hmac_key)
    adapters = {s.name: reader.read(s.name) for s in lora_tensors(model, config)}
    return write_peft_adapter(
        dest,
        adapters,
        model=model,
        config=config,
        base_model_name_or_path=base_model_name_or_path,
        overwrite=overwrite,
    )


#: What to do with a multimodal base (its vision encoder, ``mtp.*``): the merge writes
#: the text model alone.
_TEXT_ONLY_BASE = (
    "the merged checkpoint is the text model alone: write the base as the text model's "
    "checkpoint first (convert it with text_only=True to rank files, and those back to HF), "
    "then merge into that"
)


@beartype
def export_merged(
    path: "str | os.PathLike[str]",
    base: "str | os.PathLike[str]",
    dest: "str | os.PathLike[str]",
    *,
    overwrite: bool = False,
    hmac_key: bytes | None = None,
) -> Path:
    """Merge an adapter checkpoint's adapters into the HF checkpoint at ``base`` and write
    the result as a plain HF checkpoint at ``dest`` (``base``'s ``config.json`` and other
    files carried). ``base`` must be the model the adapters were trained on (its config
    must describe the same tensors)."""
    from areal_fn.runtime.hf.files import read_hf_files

    reader, model, config = _adapter_checkpoint(path, hmac_key)
    with HfCheckpoint(base) as ckpt:
        ckpt.text.left_out(text_only=False, remedy=_TEXT_ONLY_BASE)  # refused, listed
        weights = {s.name: ckpt.read_full(s.name) for s in model.tensors if s.name in ckpt.names}
    adapters = {s.name: reader.read(s.name) for s in lora_tensors(model, config)}
    return write_merged_hf(
        dest,
        weights,
        adapters,
        model=model,
        config=config,
        hf=read_hf_files(base),
        overwrite=overwrite,
    )
