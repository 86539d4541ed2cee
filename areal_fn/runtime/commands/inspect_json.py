"""``areal-fn checkpoint inspect DIR --json``: what the text view shows, as one JSON document.

The same checks run first as for the text view
(:func:`~areal_fn.runtime.checkpoint.inspect.inspect_checkpoint`): ``.metadata`` must be
plain DCP metadata (nothing unpickled), every checksum with ``--verify``, the keyed
digest when ``AREAL_FN_CHECKPOINT_KEY`` is set.
"""

import json
from pathlib import Path
from typing import Any

from areal_fn.model.lora import LoraExpertTarget, LoraTarget, lora_expert_targets, lora_targets
from areal_fn.plans.checkpoint import CheckpointManifest
from areal_fn.runtime.checkpoint.files import (
    list_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.inspect import read_unverified
from areal_fn.runtime.checkpoint.metadata import METADATA, check_metadata_file
from areal_fn.runtime.commands.output import emit_json
from areal_fn.runtime.hf.files import HF_DIR, checkpoint_hf_files

__all__ = ["cmd_inspect_json", "inspect_json"]


def _manifest(folder: Path, verify: bool, hmac_key: bytes | None) -> CheckpointManifest:
    if verify:
        return verify_checkpoint(folder, hmac_key=hmac_key)
    return read_unverified(folder, hmac_key)


def _keyed(m: CheckpointManifest, hmac_key: bytes | None) -> str:
    if hmac_key is not None:
        return "matches"  # checked above: a mismatch raised
    return "present, not checked" if m.keyed_digest is not None else "none"


def _adapter(t: LoraTarget | LoraExpertTarget) -> dict[str, Any]:
    module, experts = (
        (t.parameter, t.experts) if isinstance(t, LoraExpertTarget) else (t.module, None)
    )
    pair = zip(("lora_A", "lora_B"), t.tensors, strict=True)
    return {
        "base": t.base,
        "module": module,
        "rank": t.rank,
        "experts": experts,
        **{k: {"name": s.name, "shape": list(s.shape)} for k, s in pair},
    }


def _lora(folder: Path, m: CheckpointManifest) -> dict[str, Any] | None:
    """An adapter checkpoint's LoRA configuration (``hf/adapter_config.json``) and its
    adapters per targeted layer; None for a checkpoint of a model."""
    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.plans.lora_export import ADAPTER_CONFIG, lora_config_from_peft

    hf = checkpoint_hf_files(folder, m)
    raw = None if hf is None else dict(hf.files).get(ADAPTER_CONFIG)
    if hf is None or raw is None:
        return None
    c = lora_config_from_peft(json.loads(raw))
    model = model_from_hf_config(hf.config_dict)
    targets: list[LoraTarget | LoraExpertTarget] = [
        *lora_targets(model, c),
        *lora_expert_targets(model, c),
    ]
    return {
        "config": f"{HF_DIR}/{ADAPTER_CONFIG}",
        "rank": c.rank,
        "alpha": c.alpha,
        "dropout": c.dropout,
        "target_modules": list(c.target_modules),
        "module_ranks": dict(c.module_ranks),
        "target_parameters": list(c.target_parameters),
        "adapters": [_adapter(t) for t in targets],
    }


def inspect_json(
    path: str, *, verify: bool, max_tensors: int | None, hmac_key: bytes | None
) -> dict[str, Any]:
    """The document (keys in docs/cli.md); ``max_tensors`` None lists every tensor."""
    folder = resolve_checkpoint(path)
    m = _manifest(folder, verify, hmac_key)
    if (folder / METADATA).is_file():
        check_metadata_file(folder / METADATA)  # opcodes read, nothing unpickled
    root = folder.parent if folder != Path(path) else Path(path)
    shown = m.tensors if max_tensors is None else m.tensors[:max_tensors]
    prefix = HF_DIR + "/"
    return {
        "schema": "areal-fn.checkpoint-inspect/1",
        "path": str(folder),
        "checkpoints": [d.name for _, d in list_checkpoints(root)],
        "step": m.step,
        "data_position": json.loads(m.data_position),
        "allocation": m.allocation,
        "layout": m.layout_kind,
        "world_size": m.world_size,
        "library_version": m.library_version,
        "model": m.model,
        "num_params": sum(t.numel for t in m.tensors),
        "num_tensors": len(m.tensors),
        "optimizer": {"name": m.optimizer.name, "states": [s.name for s in m.optimizer.states]},
        "extras": list(m.extras),
        "hf_files": [f.path[len(prefix) :] for f in m.files if f.path.startswith(prefix)],
        "lora": _lora(folder, m),
        "verified": verify,
        "storage_located": bool(m.storage),
        "keyed_digest": _keyed(m, hmac_key),
        "bytes": m.nbytes,
        "bytes_per_rank": {str(r): b for r, b in m.bytes_per_rank().items()},
        "files": [{"path": f.path, "size": f.size, "algorithm": f.algorithm} for f in m.files],
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "chunks": len(t.chunks),
                "bytes": t.stored_bytes(m.optimizer.scalars),
            }
            for t in shown
        ],
    }


def cmd_inspect_json(args: Any) -> int:
    """``areal-fn checkpoint inspect DIR --json [--verify] [--tensors N]``."""
    emit_json(
        inspect_json(
            args.dir,
            verify=bool(args.verify),
            max_tensors=args.tensors,
            hmac_key=args.hmac_key,
        )
    )
    return 0
