"""Conversion on disk: an HF checkpoint <-> one safetensors file per rank of a layout.

:func:`convert_to_local` reads an HF checkpoint lazily (only the slices each rank
needs, :class:`~areal_fn.runtime.hf.io.HfCheckpoint`) and writes
``rank{r:05d}.safetensors`` per rank plus the source ``config.json`` and its other
non-weight files (generation config, tokenizer, ...: see
:mod:`~areal_fn.runtime.hf.files`), byte for byte; this is what
``areal-fn convert SRC ALLOCATION DST`` does. :func:`convert_back` streams those
files back into a sharded HF checkpoint with the same ``config.json`` and non-weight
files: canonical tensors are built one at a time (``iter_to_hf``) from zero-copy
memory-mapped views of the rank files and written atomically (``write_hf_checkpoint``).

Both are strict: every input is checked before anything is written, a mismatch raises
:class:`~areal_fn.errors.ConversionError` listing what differs, and a failure leaves
no partial output under the destination name. Nothing is cast unless ``dtype`` asks.
"""

import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import torch
from safetensors.torch import save_file

from areal_fn.errors import ConversionError
from areal_fn.layouts.layout import Layout
from areal_fn.model.quantized import Fp8Format
from areal_fn.model.spec import ModelSpec, load_hf_config, model_from_hf_config
from areal_fn.model.tensor_spec import layer_of
from areal_fn.plans.convert import iter_to_hf, iter_to_megatron
from areal_fn.runtime.hf import rank_files
from areal_fn.runtime.hf.files import HfFiles, read_hf_files
from areal_fn.runtime.hf.io import (
    HfCheckpoint,
    Tally,
    hf_owned,
    is_write_failure,
    read_safetensors_header,
    write_error,
    write_hf_checkpoint,
)
from areal_fn.runtime.hf.rank_read import _Header, _header, read_local
from areal_fn.runtime.replace_dir import check_overwrite, new_output_dir, replace_dir
from areal_fn.strategy.allocation import Allocation
from areal_fn.strategy.parse import parse_allocation
from areal_fn.typecheck import beartype

__all__ = [  # read_local lives in rank_read; kept here for its callers
    "LOCAL_FORMAT",
    "ConvertSummary",
    "convert_back",
    "convert_to_local",
    "layout_of",
    "rank_file",
    "read_local",
]

#: ``metadata["areal_fn"]`` of every rank file this module writes.
LOCAL_FORMAT = "local/1"
CONFIG = "config.json"
_PathLike = str | os.PathLike[str]
Target = Layout | Allocation | str


@attrs.frozen(kw_only=True)
class ConvertSummary:
    """What one conversion wrote."""

    path: str
    ranks: tuple[int, ...]
    tensors: int
    bytes: int
    seconds: float
    #: ``config.json`` and the other non-weight files copied unchanged (tokenizer, ...).
    carried: tuple[str, ...] = ()
    #: ``"name (reason)"`` for what the source holds that was not carried.
    not_carried: tuple[str, ...] = ()
    #: rank files read back whose checksum was verified, and those recording none
    verified: tuple[str, ...] = ()
    unverified: tuple[str, ...] = ()

    def __str__(self) -> str:
        ranks = f" for {len(self.ranks)} rank(s)" if self.ranks else ""  # torch_dist: none
        text = (
            f"{self.tensors} tensors, {self.bytes / 2**20:.1f} MiB{ranks} "
            f"in {self.seconds:.2f} s -> {self.path}"
        )
        if self.carried:
            text += f"; carried {', '.join(self.carried)}"
        if self.not_carried:
            text += f"; not carried: {', '.join(self.not_carried)}"
        return text + rank_files.describe_checks(self.verified, self.unverified)


def carried_fields(
    hf: HfFiles, dropped: Sequence[str] = (), parts: Sequence[str] = ()
) -> dict[str, tuple[str, ...]]:
    """A summary's ``carried`` / ``not_carried``: files, the MTP layers among ``dropped``,
    and ``parts`` (a multimodal checkpoint's parts left out, ``TextView.described``)."""
    layers = sorted({".".join(n.split(".")[:3]) for n in dropped if layer_of(n) is not None})
    mtp = tuple(f"{p}.* (a multi-token-prediction layer, left out as asked)" for p in layers)
    return {
        "carried": hf.names,
        "not_carried": tuple(f"{n} ({why})" for n, why in hf.skipped) + mtp + tuple(parts),
    }


def rank_file(rank: int) -> str:
    """The file name of ``rank``'s local state (``rank00003.safetensors``)."""
    return f"rank{rank:05d}.safetensors"


def _rank_of(name: str) -> int | None:
    stem = name.removesuffix(".safetensors")
    if name.endswith(".safetensors") and stem.startswith("rank") and stem[4:].isdigit():
        return int(stem[4:])
    return None


@beartype
def layout_of(model: ModelSpec, target: Target) -> tuple[Layout, str | None]:
    """The layout of ``target`` for ``model`` and its allocation string (None for a Layout).

    An allocation with several components means its training component (default
    options, as ``areal-fn plan`` shows it). A given :class:`Layout` must be one of
    ``model``: its canonical tensors are compared.
    """
    if isinstance(target, Layout):
        layout, alloc = target, None
    else:
        from areal_fn.layouts.layout_for import layout_for

        parsed = parse_allocation(target) if isinstance(target, str) else target
        comp = parsed.training if len(parsed.components) > 1 else parsed.components[0]
        layout, alloc = layout_for(model, comp), str(parsed)
    _check_same_model(layout, model)
    return layout, alloc


def _check_same_model(layout: Layout, model: ModelSpec) -> None:
    want = {t.name: t.shape for t in model.tensors}
    have = {t.name: t.shape for t in layout.canonical}
    if want == have:
        return
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    shapes = [f"{n}: {have[n]} != {want[n]}" for n in want if n in have and have[n] != want[n]]
    raise ConversionError(
        f"the {layout.kind} layout is not one of this {model.model_type} model: "
        f"tensors it lacks {missing[:5]}, tensors the model lacks {extra[:5]}, "
        f"shapes {shapes[:5]}; build the layout from the same config"
    )


def _check_ranks(ranks: Sequence[int], world: int) -> tuple[int, ...]:
    bad = [r for r in ranks if not 0 <= r < world]
    dup = sorted({r for r in ranks if list(ranks).count(r) > 1})
    if bad or dup or not ranks:
        raise ConversionError(
            f"ranks={list(ranks)}: out of range {bad}, repeated {dup}; pick distinct ranks in "
            f"0..{world - 1} (the layout has {world} ranks)"
        )
    return tuple(ranks)


# ------------------------------------------------------------ HF -> per rank


@beartype
def convert_to_local(
    src_hf_dir: _PathLike,
    target: Target,
    dst_dir: _PathLike,
    *,
    ranks: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    mtp: bool = False,
    drop_mtp: bool = False,
    text_only: bool = False,
) -> ConvertSummary:
    """Write ``rank{r:05d}.safetensors`` for ``ranks`` (default all) of ``target``.

    ``target``: an allocation or a :class:`Layout` of the model in ``src_hf_dir``, whose
    checkpoint is checked first (names, shapes); each rank reads only its slices. A new
    ``dst_dir`` appears whole or not at all; an existing one (``overwrite=True``, holding
    only rank files, ``config.json`` and the files carried: ``check_overwrite``) is
    replaced whole in one step (``replace_dir``); ``ranks`` naming some ranks write into
    an existing directory of the same allocation, file by file. Non-weight files are
    copied unchanged, listed in the summary with what was not carried; ``progress(name)``
    per tensor; ``mtp=True`` holds MTP layers; ``drop_mtp``, ``text_only``: HfCheckpoint.check.
    """
    src, dst = Path(src_hf_dir), Path(dst_dir)
    start = time.perf_counter()
    model = model_from_hf_config(src, mtp=mtp)
    layout, alloc = layout_of(model, target)
    chosen = _check_ranks(range(layout.world_size) if ranks is None else ranks, layout.world_size)
    tensors = nbytes = 0
    with HfCheckpoint(src) as ckpt:
        dropped = ckpt.check(model, drop_mtp=drop_mtp, text_only=text_only)
        hf = read_hf_files(src, weights=ckpt.files)
        owned = rank_files_owned([CONFIG, *hf.names])
        check_overwrite(
            dst, overwrite=overwrite, owned=owned, kind="rank files", error=ConversionError
        )
        existed = dst.exists()
        # some ranks into an existing directory: beside the other ranks' files
        into = existed and len(chosen) < layout.world_size
        if into:
            _check_same_conversion(dst, _rank_metadata(layout, alloc, model, 0))
        dst.parent.mkdir(parents=True, exist_ok=True)
        out = dst if into else new_output_dir(dst)
        writing: Path | None = None  # the file being written (None: reading the checkpoint)
        done: list[int] = []
        try:
            for r in chosen:
                state, metadata = _rank_payload(ckpt, layout, alloc, model, r, dtype, progress)
                tensors += len(state)
                nbytes += sum(t.numel() * t.element_size() for t in state.values())
                tmp = out / f".{rank_file(r)}.tmp"
                writing = dst / rank_file(r)
                save_file(state, str(tmp), metadata=metadata)
                os.replace(tmp, out / rank_file(r))
                writing = None
                done.append(r)
                del state
            for name, data in ((CONFIG, hf.config), *hf.files):
                writing = dst / name
                (out / f".{name}.tmp").write_bytes(data)
                os.replace(out / f".{name}.tmp", out / name)
            writing = dst
            if not into:
                replace_dir(out, dst)
        except BaseException as e:
            names = [rank_file(r) for r in chosen] + [CONFIG] + [n for n, _ in hf.files]
            _discard(out, whole=not into, names=names)
            if writing is not None and is_write_failure(e):
                left = _left(dst, existed=existed, into=into, done=done)
                raise write_error(e, writing, dest=dst, left=left) from None
            raise
    return ConvertSummary(
        path=str(dst),
        ranks=chosen,
        tensors=tensors,
        bytes=nbytes,
        seconds=round(time.perf_counter() - start, 4),
        **carried_fields(hf, dropped, ckpt.text.described(dropped)),
    )


def _rank_payload(
    ckpt: HfCheckpoint,
    layout: Layout,
    alloc: str | None,
    model: ModelSpec,
    r: int,
    dtype: torch.dtype | None,
    progress: Callable[[str], None] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rank ``r``'s tensors read from the checkpoint, and its file's metadata (checksum in)."""
    state = _rank_state(ckpt, layout, r, dtype=dtype, progress=progress)
    metadata = _rank_metadata(layout, alloc, model, r)
    metadata[rank_files.CHECKSUM] = rank_files.tensors_digest(state)
    return state, metadata


def _rank_state(
    ckpt: HfCheckpoint,
    layout: Layout,
    rank: int,
    *,
    dtype: torch.dtype | None,
    progress: Callable[[str], None] | None,
) -> dict[str, torch.Tensor]:
    """``rank``'s local tensors, read from ``ckpt``; ``progress`` hears each name."""
    state: dict[str, torch.Tensor] = {}
    for name, t in iter_to_megatron(ckpt.read, layout, rank, dtype=dtype):
        state[name] = t
        if progress is not None:
            progress(name)
    return state


def _rank_metadata(
    layout: Layout, alloc: str | None, model: ModelSpec, rank: int
) -> dict[str, str]:
    """``metadata`` of ``rank``'s file: the format, the layout, the allocation, the model."""
    return {
        "format": "pt",
        "areal_fn": LOCAL_FORMAT,
        "layout": layout.kind,
        "allocation": alloc or "",
        "rank": str(rank),
        "world_size": str(layout.world_size),
        "model_type": model.model_type,
        **({"mtp_layers": str(model.mtp_layers)} if model.mtp_layers else {}),
    }


def _discard(out: Path, *, whole: bool, names: Sequence[str]) -> None:
    """Remove what a failed conversion wrote: all of ``out`` (a temporary directory)
    when ``whole``, else only the temporary files of ``names`` (not what it held)."""
    if whole:
        shutil.rmtree(out, ignore_errors=True)
    else:
        for name in names:
            (out / f".{name}.tmp").unlink(missing_ok=True)


def _left(dst: Path, *, existed: bool, into: bool, done: Sequence[int]) -> str:
    """What a failed conversion left of ``dst`` (``done``: the ranks it wrote there)."""
    if not existed:
        return f"nothing was written to {dst}"
    return f"{dst} holds what it held before" + (
        f" but the files of ranks {list(done)}, written before the failure" if into and done else ""
    )


#: Rank files, and the temporary files a conversion into a directory leaves when killed.
_RANK_FILE = re.compile(r"\.?rank\d{5}\.safetensors(\.tmp)?")


def rank_files_owned(names: Sequence[str]) -> Callable[[str], bool]:
    """Whether a file in the directory rank files replace is one they replace: one of
    ``names`` (``config.json`` and the files carried) or its temporary file, or a rank
    file (``rank00003.safetensors``) of this or an earlier conversion."""
    written = frozenset([*names, *(f".{n}.tmp" for n in names)])
    return lambda name: name in written or _RANK_FILE.fullmatch(name) is not None


#: Metadata that must agree between the rank files of one conversion.
_SAME = ("areal_fn", "layout", "allocation", "world_size", "model_type")


def _check_same_conversion(dst: Path, ours: Mapping[str, str]) -> None:
    """``ConversionError`` when a rank file in ``dst`` was written for another
    allocation (or layout, world size, model type) than ``ours`` (rank 0's metadata)."""
    for path in sorted(dst.iterdir()):
        if _rank_of(path.name) is None:
            continue
        header, _, _ = read_safetensors_header(path)
        theirs = header.get("__metadata__") or {}
        differ = [
            f"{k} {theirs.get(k)!r}, not {ours[k]!r}" for k in _SAME if theirs.get(k) != ours[k]
        ]
        if differ:
            raise ConversionError(
                f"{path} was written by another conversion ({'; '.join(differ)}); ranks= "
                f"writes some ranks beside the other ranks' files, which must be of the same "
                f"conversion: convert every rank (without ranks=) to replace them all, or "
                f"choose another directory"
            )


# ------------------------------------------------------------ per rank -> HF


def _local_files(src: Path) -> dict[int, Path]:
    if not src.is_dir():
        raise ConversionError(f"{src} is not a directory of per-rank safetensors files")
    files = {}
    for p in sorted(src.iterdir()):
        r = _rank_of(p.name)
        if r is not None:
            files[r] = p
    if not files:
        raise ConversionError(
            f"{src} holds no rank*.safetensors files; convert an HF checkpoint with "
            "convert_to_local (areal-fn convert) first"
        )
    return files


def _check_files(
    headers: Mapping[int, _Header], layout: Layout, alloc: str | None, model: ModelSpec
) -> None:
    problems = []
    world = layout.world_size
    missing = [r for r in range(world) if r not in headers]
    extra = sorted(r for r in headers if r >= world)
    if missing:
        problems.append(f"no file for ranks {missing[:8]}")
    if extra:
        problems.append(f"files for ranks {extra[:8]} outside the layout's {world} ranks")
    for r, h in sorted(headers.items()):
        meta = dict(h.metadata)
        said = {
            "rank": (meta.get("rank"), str(r)),
            "world_size": (meta.get("world_size"), str(world)),
            "allocation": (meta.get("allocation") or None, alloc),
            "model_type": (meta.get("model_type"), model.model_type),
        }
        for key, (got, want) in said.items():
            if got is not None and want is not None and got != want:
                problems.append(f"{h.path.name} says {key}={got!r}, expected {want!r}")
    dtype_of = {(r, name): code for r, h in headers.items() for name, code, _, _ in h.entries}
    for spec in layout.canonical:
        codes = {
            dtype_of[(r, local)]
            for r, local, _ in layout.holders(spec.name)
            if (r, local) in dtype_of
        }
        if len(codes) > 1:
            problems.append(f"{spec.name} is held in several dtypes {sorted(codes)}")
    if problems:
        raise ConversionError(
            f"per-rank files do not match the {layout.kind} layout"
            f"{f' {alloc}' if alloc else ''}: " + "; ".join(problems[:12])
        )


def _model_of(src: Path, model: ModelSpec | None, *, mtp: bool) -> ModelSpec:
    """``model``, else the one of ``src/config.json``; the two must agree when both are."""
    if model is None:
        if not (src / CONFIG).is_file():
            raise ConversionError(f"{src} has no {CONFIG}; pass model= (a ModelSpec)")
        return model_from_hf_config(load_hf_config(src / CONFIG), mtp=mtp)
    if (src / CONFIG).is_file():
        config = load_hf_config(src / CONFIG)
        if model_from_hf_config(config, mtp=mtp).tensors != model.tensors:
            raise ConversionError(
                f"{src / CONFIG} describes another model than model=; drop model= or the file"
            )
    return model


@beartype
def convert_back(
    src_dir: _PathLike,
    target: Target | None,
    dst_hf_dir: _PathLike,
    *,
    model: ModelSpec | None = None,
    max_shard_bytes: int = 5 << 30,
    check_replicas: bool = True,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    fp8: Fp8Format | None = None,
) -> ConvertSummary:
    """Per-rank safetensors files (every rank of ``target``) -> a sharded HF checkpoint.

    ``target`` is the allocation or layout the files were written for (``None``: the
    allocation recorded in the files). ``model`` defaults to ``src_dir/config.json``,
    which is copied to the checkpoint unchanged (otherwise ``model.hf_config()`` is
    written, and the summary says so), as are the other non-weight files of ``src_dir``
    (tokenizer, generation config); with the multi-token-prediction layers when the files
    record them (``mtp_layers``). Refused, before anything is written, with every mismatch listed: missing
    or extra rank files, files written for another allocation, world size or model
    type, a tensor held in several dtypes, local tensors with other names or shapes.
    With ``check_replicas`` every replicated copy must agree bitwise. Every file's
    recorded checksum (:mod:`~areal_fn.runtime.hf.rank_files`) is verified before
    anything is written. ``progress`` is called with each canonical tensor name written.
    ``fp8`` writes the weights it quantises as block FP8 with their scales and says so in
    ``config.json`` (``write_hf_checkpoint(fp8=)``); the summary counts the tensors and
    bytes of the model in its own dtype. Without it a ``config.json`` saying FP8 or MXFP4
    (carried from such a source) loses its ``quantization_config``: the weights are not.
    """
    src, dst = Path(src_dir), Path(dst_hf_dir)
    start = time.perf_counter()
    files = _local_files(src)
    headers = {r: _header(p) for r, p in files.items()}
    metadata = {h.path.name: dict(h.metadata) for h in headers.values()}
    mtp = any(m.get("mtp_layers", "0") != "0" for m in metadata.values())  # written with them
    model = _model_of(src, model, mtp=mtp)
    if target is None:
        target = rank_files.recorded_allocation(metadata, str(src))
    elif not isinstance(target, Layout):
        rank_files.check_recorded(metadata, target, str(src))
    layout, alloc = layout_of(model, target)
    _check_files(headers, layout, alloc, model)
    hf = read_hf_files(src, weights=[p.name for p in files.values()], config=model.hf_config())
    check_overwrite(
        dst,
        overwrite=overwrite,
        owned=hf_owned([CONFIG, *hf.names]),
        kind="HF checkpoint",
        error=ConversionError,
    )
    states = {r: read_local(files[r]) for r in range(layout.world_size)}
    unverified = rank_files.check_digests(metadata, {files[r].name: s for r, s in states.items()})
    tally = Tally(progress)

    write_hf_checkpoint(
        dst,
        tally.count(iter_to_hf(states, layout, check_replicas=check_replicas)),
        config=hf.config,
        model=model,
        files=hf.files,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        fp8=fp8,
    )
    return ConvertSummary(
        path=str(dst),
        ranks=tuple(range(layout.world_size)),
        tensors=tally.tensors,
        bytes=tally.bytes,
        seconds=round(time.perf_counter() - start, 4),
        **carried_fields(hf),
        verified=tuple(sorted(set(metadata) - set(unverified))),
        unverified=unverified,
    )
