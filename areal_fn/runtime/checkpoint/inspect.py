"""Reading canonical tensors out of a checkpoint, HF export, and ``checkpoint inspect``."""

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
)

from areal_fn.errors import CheckpointError
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.checkpoint import (
    CheckpointManifest,
    SavedTensor,
    check_model,
    optim_key,
)
from areal_fn.plans.checkpoint.keyed import KEY_ENV, check_keyed_digest
from areal_fn.runtime.checkpoint.dcp import _ChunkReader, _LoadPlanner, _read_into, _Reshaped
from areal_fn.runtime.checkpoint.files import (
    _latest_name,
    check_sizes,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.metadata import METADATA, check_metadata_file, dcp_metadata
from areal_fn.runtime.hf.files import checkpoint_hf_files, describe_checkpoint_hf_files
from areal_fn.sharding.box import Box

# -- reading canonical tensors -------------------------------------------------------


def _read_box(
    storage: "_ChunkReader",
    key: str,
    chunks: tuple[Box, ...],
    box: Box,
    dtype: torch.dtype,
    source: str,
) -> torch.Tensor:
    """``box`` of the stored tensor ``key`` (stored as ``chunks``), read through ``storage``."""
    out = torch.empty(box.shape, dtype=dtype)
    items: list[ReadItem] = []
    dests: list[torch.Tensor | _Reshaped] = []
    for chunk in chunks:
        inter = chunk.intersect(box)
        if inter is not None:
            _read_into(items, dests, key, inter, chunk, out[inter.relative_to(box).slices()])
    storage.read_data(LoadPlan(items), _LoadPlanner(items, dests, source)).wait()
    return out


class CheckpointReader:
    """Canonical tensors of a checkpoint, read box by box (a ``convert.Reader``).

    ``read(name, box)`` returns ``box`` of a parameter; ``read_state(name, state, box)``
    of an optimizer state. Only the chunks a box touches are read. The files' sizes are
    checked first, their checksums too with ``verify``, the keyed digest with ``hmac_key``.
    Nothing is unpickled unless ``trust_pickle`` for a checkpoint saved before the
    manifest located its entries (see :func:`~areal_fn.runtime.checkpoint.api.load_checkpoint`).
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        verify: bool = True,
        trust_pickle: bool = False,
        hmac_key: bytes | None = None,
    ) -> None:
        self.path = resolve_checkpoint(path)
        self.manifest = (
            verify_checkpoint(self.path, hmac_key=hmac_key)
            if verify
            else read_unverified(self.path, hmac_key)  # sizes checked there
        )
        metadata = dcp_metadata(self.path, self.manifest, trust_pickle=trust_pickle)
        self._storage = _ChunkReader(self.path, metadata=metadata)
        self._storage.set_up_storage_reader(metadata, True)
        self._saved = {t.name: t for t in self.manifest.tensors}

    def _saved_tensor(self, name: str) -> SavedTensor:
        saved = self._saved.get(name)
        if saved is None:
            raise CheckpointError(f"the checkpoint {self.path} holds no tensor {name!r}")
        return saved

    def _read(self, key: str, chunks: tuple[Box, ...], box: Box, dtype: str) -> torch.Tensor:
        return _read_box(self._storage, key, chunks, box, torch_dtype(dtype), str(self.path))

    def _box(self, saved: SavedTensor, box: "Box | None") -> Box:
        full = Box.full(saved.shape)
        if box is None:
            return full
        if box.ndim != full.ndim or not full.contains(box):
            raise CheckpointError(
                f"box {box} does not lie inside {saved.name!r} of shape {saved.shape}"
            )
        return box

    def read(self, name: str, box: "Box | None" = None) -> torch.Tensor:
        """``box`` (default: all) of parameter ``name``, in its stored dtype."""
        saved = self._saved_tensor(name)
        chunks = tuple(c.box for c in saved.chunks)
        return self._read(name, chunks, self._box(saved, box), saved.dtype)

    def __call__(self, name: str, box: Box) -> torch.Tensor:
        return self.read(name, box)

    def read_state(self, name: str, state: str, box: "Box | None" = None) -> torch.Tensor:
        """``box`` of optimizer state ``state`` of ``name`` (a scalar state ignores ``box``)."""
        saved = self._saved_tensor(name)
        kinds = {s.name: s.kind for s in self.manifest.optimizer.states}
        if state not in kinds:
            raise CheckpointError(
                f"the checkpoint's optimizer {self.manifest.optimizer} has no state {state!r}"
            )
        dtype = dict(saved.state_dtypes)[state]
        if kinds[state] == "scalar":
            scalar = Box(ranges=())
            return self._read(optim_key(name, state), (scalar,), scalar, dtype)
        chunks = tuple(c.box for c in saved.chunks)
        return self._read(optim_key(name, state), chunks, self._box(saved, box), dtype)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def read_unverified(folder: Path, hmac_key: bytes | None) -> CheckpointManifest:
    """The manifest, its keyed digest checked when a key is given, and every file it
    lists present with the size it records (checksums are not read: ``verify`` does)."""
    manifest = read_manifest(folder)
    if hmac_key is not None:
        check_keyed_digest(manifest, hmac_key, source=str(folder))
    check_sizes(folder, manifest)
    return manifest


def export_hf(
    path: "str | os.PathLike[str]",
    dest: "str | os.PathLike[str]",
    *,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    trust_pickle: bool = False,
    hmac_key: bytes | None = None,
) -> Path:
    """Write a checkpoint's parameters as a Hugging Face safetensors checkpoint.

    Saved with ``hf=``, the checkpoint's ``hf/`` files (``config.json``, tokenizer,
    generation config) are written next to the weights byte for byte; otherwise
    ``config.json`` is the manifest's model config (``ModelSpec.hf_config()``, see
    :func:`~areal_fn.runtime.hf.files.describe_checkpoint_hf_files`). ``trust_pickle``
    and ``hmac_key`` as for :class:`CheckpointReader`.
    """
    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.hf.io import write_hf_checkpoint

    # every file's checksum checked, hf/ included
    reader = CheckpointReader(path, trust_pickle=trust_pickle, hmac_key=hmac_key)
    if _lora_lines(reader.path, reader.manifest):
        raise CheckpointError(
            f"{reader.path} holds LoRA adapters, not a model; write them with areal-fn convert "
            f"{reader.path} DST --to-hf (PEFT's format) or --to-hf --merge BASE (merged into "
            "the base model), or export_peft / export_merged"
        )
    model = model_from_hf_config(reader.manifest.model)
    check_model(reader.manifest, model.tensors, source=str(reader.path))
    hf = checkpoint_hf_files(reader.path, reader.manifest)
    return write_hf_checkpoint(
        dest,
        ((t.name, reader.read(t.name)) for t in reader.manifest.tensors),
        config=hf.config if hf is not None else reader.manifest.model,
        files=hf.files if hf is not None else (),
        model=model,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


# -- inspect -------------------------------------------------------------------------


def _algorithms(m: CheckpointManifest) -> str:
    """The checksum algorithms the manifest names, e.g. ``blake3``."""
    return ", ".join(sorted({f.algorithm for f in m.files})) or "no files"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _security_lines(
    folder: Path, m: CheckpointManifest, hmac_key: bytes | None, *, verify: bool
) -> list[str]:
    """What reading it takes (a pickle or not), and whether a job holding the key saved it."""
    if (folder / METADATA).is_file():
        check_metadata_file(folder / METADATA)  # opcodes read, nothing unpickled
    storage = (
        "  storage: located by the manifest (read without unpickling anything)"
        if m.storage
        else "  storage: not located by the manifest (saved before it recorded that): reading "
        "it unpickles .metadata, only with trust_pickle=True (--trust-pickle); save it again "
        "to read it without"
    )
    if hmac_key is not None:
        keyed = "  keyed digest: matches the key given" + (  # check_keyed_digest passed
            " (every file's checksum verified: it vouches for the files too)"
            if verify
            else " (it vouches for the manifest; pass verify to check the files against it)"
        )
    elif m.keyed_digest is not None:
        keyed = f"  keyed digest: present, not checked (no key given: hmac_key=, or {KEY_ENV})"
    else:
        keyed = "  keyed digest: none (saved without a key)"
    return [storage, keyed]


def _lora_lines(folder: Path, m: CheckpointManifest) -> list[str]:
    """An adapter checkpoint's line: its LoRA configuration (``hf/adapter_config.json``)."""
    from areal_fn.plans.lora_export import ADAPTER_CONFIG, lora_config_from_peft

    hf = checkpoint_hf_files(folder, m)
    raw = None if hf is None else dict(hf.files).get(ADAPTER_CONFIG)
    if raw is None:
        return []
    c = lora_config_from_peft(json.loads(raw))
    ranks = "".join(f", {mod} r={r}" for mod, r in c.module_ranks)
    experts = f", routed experts {list(c.target_parameters)}" if c.target_parameters else ""
    return [
        f"  LoRA adapters of a frozen base (hf/{ADAPTER_CONFIG}): r={c.rank}, alpha={c.alpha}, "
        f"dropout={c.dropout}, targets {list(c.target_modules)}{ranks}{experts}; export with "
        "convert DIR DST --to-hf (PEFT) or --to-hf --merge BASE"
    ]


def inspect_checkpoint(
    path: "str | os.PathLike[str]",
    *,
    verify: bool = False,
    max_tensors: int = 24,
    hmac_key: bytes | None = None,
) -> str:
    """A readable summary: manifest, strategy, tensors, sizes, files (and checksums with
    ``verify``). ``.metadata`` is checked to be plain DCP metadata (its opcodes read,
    nothing unpickled); with ``hmac_key`` the keyed digest must match it."""
    p = Path(path)
    folder = resolve_checkpoint(p)
    m = (
        verify_checkpoint(folder, hmac_key=hmac_key)
        if verify
        else read_unverified(folder, hmac_key)
    )
    security = _security_lines(folder, m, hmac_key, verify=verify)
    cfg = m.model
    lines = [f"checkpoint {folder}"]
    root = folder.parent if folder != p else p
    others = list_checkpoints(root)
    if others:
        latest = _latest_name(root)
        lines.append(
            f"  in {root}: "
            + ", ".join(f"{d.name}{' (latest)' if d.name == latest else ''}" for _, d in others)
        )
    params = sum(t.numel for t in m.tensors)
    lines += [
        f"  step {m.step}, data position {m.data_position}",
        f"  saved with allocation {m.allocation} ({m.layout_kind} layout, {m.world_size} ranks), "
        f"areal_fn {m.library_version}",
        f"  model {cfg.get('model_type')}: {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
        f"vocab {cfg.get('vocab_size')}, {params:,} parameters in {len(m.tensors)} canonical tensors",
        f"  optimizer {m.optimizer}",
        f"  extras {list(m.extras)}",
        f"  {describe_checkpoint_hf_files(m)}",
        *_lora_lines(folder, m),
        f"  files {len(m.files)}, {_human(m.nbytes)}"
        + (
            f" (every checksum verified: {_algorithms(m)})"
            if verify
            else " (checksums not verified; pass verify)"
        ),
        *security,
    ]
    scalars = m.optimizer.scalars  # Adam's step: one value per tensor, not one per element
    per_rank = m.bytes_per_rank()
    lines.append(
        "  bytes written per rank: "
        + ", ".join(f"{r}: {_human(b)}" for r, b in sorted(per_rank.items()))
    )
    lines.append(f"  {'tensor':<52} {'shape':<16} {'dtype':<9} {'chunks':>6} {'bytes':>10}")
    for t in m.tensors[:max_tensors]:
        lines.append(
            f"  {t.name:<52} {'x'.join(map(str, t.shape)):<16} {t.dtype:<9} {len(t.chunks):>6} {_human(t.stored_bytes(scalars)):>10}"
        )
    if len(m.tensors) > max_tensors:
        lines.append(f"  ... {len(m.tensors) - max_tensors} more tensors")
    lines.append("  files: " + ", ".join(f"{f.path} ({_human(f.size)})" for f in m.files[:12]))
    return "\n".join(lines)


def cmd_checkpoint_inspect(args: Any) -> int:
    """``areal-fn checkpoint inspect DIR [--verify] [--tensors N]`` (``args.hmac_key``: the
    key the CLI read from the environment, or None)."""
    print(
        inspect_checkpoint(
            args.dir,
            verify=bool(getattr(args, "verify", False)),
            max_tensors=int(getattr(args, "tensors", 24)),
            hmac_key=getattr(args, "hmac_key", None),
        )
    )
    return 0


def cmd_checkpoint_export_hf(args: Any) -> int:
    """``areal-fn checkpoint export-hf DIR DEST [--overwrite] [--trust-pickle]``."""
    out = export_hf(
        args.dir,
        args.dest,
        overwrite=bool(getattr(args, "overwrite", False)),
        trust_pickle=bool(getattr(args, "trust_pickle", False)),
        hmac_key=getattr(args, "hmac_key", None),
    )
    print(f"wrote {out}; {describe_checkpoint_hf_files(read_manifest(args.dir))}")
    return 0
