"""``areal-fn checkpoint inspect DIR --json``: what the text view shows, as one JSON document.

The same checks run first as for the text view
(:func:`~areal_fn.runtime.checkpoint.inspect.inspect_checkpoint`): ``.metadata`` must be
plain DCP metadata (nothing unpickled), every checksum with ``--verify``, the keyed
digest when ``AREAL_FN_CHECKPOINT_KEY`` is set.
"""

import json
from pathlib import Path
from typing import Any

from areal_fn.plans.checkpoint import CheckpointManifest
from areal_fn.plans.checkpoint_keyed import check_keyed_digest
from areal_fn.runtime.checkpoint.files import (
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.metadata import METADATA, check_metadata_file
from areal_fn.runtime.commands.output import emit_json
from areal_fn.runtime.hf.files import HF_DIR

__all__ = ["cmd_inspect_json", "inspect_json"]


def _manifest(folder: Path, verify: bool, hmac_key: bytes | None) -> CheckpointManifest:
    if verify:
        return verify_checkpoint(folder, hmac_key=hmac_key)
    manifest = read_manifest(folder)
    if hmac_key is not None:
        check_keyed_digest(manifest, hmac_key, source=str(folder))
    return manifest


def _keyed(m: CheckpointManifest, hmac_key: bytes | None) -> str:
    if hmac_key is not None:
        return "matches"  # checked above: a mismatch raised
    return "present, not checked" if m.keyed_digest is not None else "none"


def _bytes_per_rank(m: CheckpointManifest) -> dict[str, int]:
    per_rank: dict[int, int] = {}
    for t in m.tensors:
        item = t.nbytes // max(1, t.numel)
        for c in t.chunks:
            per_rank[c.rank] = per_rank.get(c.rank, 0) + c.box.numel * item
    return {str(r): b for r, b in sorted(per_rank.items())}


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
        "verified": verify,
        "storage_located": bool(m.storage),
        "keyed_digest": _keyed(m, hmac_key),
        "bytes": m.nbytes,
        "bytes_per_rank": _bytes_per_rank(m),
        "files": [{"path": f.path, "size": f.size, "algorithm": f.algorithm} for f in m.files],
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "chunks": len(t.chunks),
                "bytes": t.nbytes,
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
