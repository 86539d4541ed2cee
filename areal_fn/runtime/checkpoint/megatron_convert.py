"""An HF checkpoint <-> a Megatron-Core ``torch_dist`` checkpoint, on disk.

:func:`convert_to_torch_dist` is ``areal-fn convert SRC megatron:... DST --format
torch_dist``: the HF checkpoint is read lazily, one local tensor at a time, and written
as the directory Megatron-LM's ``--load DST`` reads
(:mod:`~areal_fn.runtime.checkpoint.megatron_lm`): ``DST/latest_checkpointed_iteration.txt``
says ``release`` and ``DST/release/`` holds the dist checkpoint that Megatron-Core's
``dist_checkpointing.load`` reads into a ``GPTModel`` under the allocation's strategy or
any other (TP/PP/EP/ETP), the vocabulary padded as Megatron pads it for the allocation's
TP. ``config.json`` and the other non-weight files of SRC are copied into DST.
:func:`convert_torch_dist_to_hf` is ``convert SRC DST --to-hf`` of such a directory, of
one Megatron-LM saved, or of a dist checkpoint directory itself (ours before the
tracker, or Megatron-Core's own).
"""

import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from areal_fn.errors import ConversionError
from areal_fn.layouts.layout import LayoutKind
from areal_fn.layouts.vocab import padded_vocab_size
from areal_fn.model.spec import ModelSpec, load_hf_config, model_from_hf_config
from areal_fn.runtime.checkpoint.megatron import (
    export_megatron_checkpoint,
    read_megatron_state,
    torch_dist_owned,
)
from areal_fn.runtime.checkpoint.megatron_keys import LayerKeys, LayerSpec, default_layer_keys
from areal_fn.runtime.checkpoint.megatron_lm import (
    RELEASE,
    TRACKER,
    dist_checkpoint_dir,
    make_release,
)
from areal_fn.runtime.checkpoint.metadata import METADATA
from areal_fn.runtime.hf.convert import ConvertSummary, carried_fields, layout_of
from areal_fn.runtime.hf.files import read_hf_files
from areal_fn.runtime.hf.io import HfCheckpoint, Tally, hf_owned, write_hf_checkpoint
from areal_fn.runtime.replace_dir import check_overwrite, new_output_dir, replace_dir
from areal_fn.sharding.box import Box
from areal_fn.strategy.parse import parse_allocation
from areal_fn.typecheck import beartype

__all__ = ["MCORE_FILES", "convert_to_torch_dist", "convert_torch_dist_to_hf", "torch_dist_options"]

_PathLike = str | os.PathLike[str]
#: the files of a torch_dist checkpoint (besides its ``*.distcp`` data files)
MCORE_FILES = (METADATA, "common.pt", "metadata.json")


def _mcore_files(folder: Path) -> list[str]:
    """The entries of ``folder`` that are the checkpoint (not carried to HF): the dist
    checkpoint's files, or Megatron-LM's tracker and the directory it names."""
    ckpt = dist_checkpoint_dir(folder)
    if ckpt != folder:
        return [TRACKER, ckpt.name]
    return [*MCORE_FILES, *sorted(p.name for p in folder.glob("*.distcp"))]


def _owned(names: Iterable[str]) -> Callable[[str], bool]:
    """What ``convert_to_torch_dist`` replaces in DST: Megatron-LM's tracker, the files
    of ``release/`` and those of a flat torch_dist checkpoint, and ``names``."""
    flat = torch_dist_owned(names)
    inner = torch_dist_owned(())
    prefix = f"{RELEASE}/"
    return lambda n: n == TRACKER or flat(n) or (n.startswith(prefix) and inner(n[len(prefix) :]))


def _check_dst(src: Path, dst: Path, names: Iterable[str], overwrite: bool) -> None:
    """Refuse an HF file that would take the name of Megatron-LM's tracker or checkpoint,
    and a ``dst`` the conversion may not replace (``check_overwrite``)."""
    for name in names:
        if name in (TRACKER, RELEASE):
            raise ConversionError(
                f"{src / name}: --format torch_dist writes Megatron-LM's own {name} in DST, so "
                f"this file of SRC cannot be carried; move it out of {src}"
            )
    check_overwrite(
        dst,
        overwrite=overwrite,
        owned=_owned(names),
        kind="torch_dist checkpoint",
        error=ConversionError,
        subdirs=(RELEASE,),
    )


@beartype
def torch_dist_options(model: ModelSpec, allocation: str) -> tuple[int, int]:
    """``(vocab_size_padded, tp)`` of a torch_dist checkpoint for ``allocation``: the
    vocabulary padded as Megatron pads it (a multiple of 128 * tp). ``ConversionError``
    unless the allocation is one megatron component."""
    comps = parse_allocation(allocation).components
    if len(comps) != 1 or comps[0].backend.value != "megatron":
        raise ConversionError(
            f"--format torch_dist writes Megatron-Core's own checkpoint, so it needs a megatron "
            f"allocation, not {allocation}; give the megatron component (e.g. megatron:t2p2) "
            "or use --format rank-files"
        )
    tp = comps[0].dims.tp
    return padded_vocab_size(model.vocab_size, tp=tp), tp


def _dtypes(ckpt: HfCheckpoint) -> dict[str, torch.dtype]:
    """Each tensor's dtype in the checkpoint (one element read, memory-mapped)."""
    out: dict[str, torch.dtype] = {}
    for name in ckpt.names:
        shape = ckpt.shape(name)
        box = Box(ranges=tuple((0, min(d, 1)) for d in shape))
        out[name] = ckpt.read(name, box).dtype
    return out


@beartype
def convert_to_torch_dist(
    src_hf_dir: _PathLike,
    allocation: str,
    dst_dir: _PathLike,
    *,
    layer_spec: LayerSpec = "te",
    layer_keys: LayerKeys | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    drop_mtp: bool = False,
    text_only: bool = False,
) -> tuple[ConvertSummary, dict[str, object]]:
    """Write the HF checkpoint in ``src_hf_dir`` as a Megatron-Core ``torch_dist``
    checkpoint for ``allocation`` (one megatron component) in ``dst_dir``, atomically:
    what Megatron-LM's ``--load dst_dir`` reads (``latest_checkpointed_iteration.txt``
    saying ``release``, the checkpoint in ``release/`` with Megatron-LM's
    ``checkpoint_version`` in its common state), with ``config.json`` and the other
    non-weight files of ``src_hf_dir`` beside them.

    The model must fit the allocation (checked first); the vocabulary is padded to
    Megatron's size for its TP. ``layer_spec`` / ``layer_keys``: see
    :func:`~areal_fn.runtime.checkpoint.megatron.export_megatron_checkpoint`. Returns
    the summary and the options written (``vocab_size_padded``, ``layer_spec``,
    ``layer_keys``). ``drop_mtp`` / ``text_only`` (Megatron's layout holds no MTP layers):
    :meth:`~areal_fn.runtime.hf.io.HfCheckpoint.check`; what they leave out is listed.
    """
    src, dst = Path(src_hf_dir), Path(dst_dir)
    start = time.perf_counter()
    model = model_from_hf_config(src)
    rows, _ = torch_dist_options(model, allocation)
    layout, _ = layout_of(model, allocation)  # the model fits the strategy (else an error)
    assert layout.kind is LayoutKind.MEGATRON
    keys = layer_keys or default_layer_keys(model)
    counted = [0, 0]
    sizes = {t.name: t.shape for t in model.tensors}

    def tick(name: str) -> None:
        counted[0] += 1
        if progress is not None:
            progress(name)

    with HfCheckpoint(src) as ckpt:
        dropped = ckpt.check(model, drop_mtp=drop_mtp, text_only=text_only)
        hf = read_hf_files(src, weights=ckpt.files)
        _check_dst(src, dst, hf.names, overwrite)
        dtypes = _dtypes(ckpt)
        dst.parent.mkdir(parents=True, exist_ok=True)
        work = new_output_dir(dst)
        try:
            out = work / "ckpt"
            out.mkdir()
            export_megatron_checkpoint(
                ckpt.read,
                model,
                out / RELEASE,
                vocab_size_padded=rows,
                layer_spec=layer_spec,
                layer_keys=keys,
                dtypes=dtypes,
                progress=tick,
            )
            for name, data in (("config.json", hf.config), *hf.files):
                (out / name).write_bytes(data)
            make_release(out)
            replace_dir(out, dst)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    counted[1] = sum(math.prod(shape) * dtypes[name].itemsize for name, shape in sizes.items())
    summary = ConvertSummary(
        path=str(dst),
        ranks=(),
        tensors=counted[0],
        bytes=counted[1],
        seconds=round(time.perf_counter() - start, 4),
        **carried_fields(hf, dropped, ckpt.text.described(dropped)),
    )
    return summary, {"vocab_size_padded": rows, "layer_spec": layer_spec, "layer_keys": keys}


def _model_of(src: Path, model: ModelSpec | None) -> ModelSpec:
    config = src / "config.json"
    if model is None:
        if not config.is_file():
            raise ConversionError(f"{src} has no config.json; pass model= (a ModelSpec)")
        return model_from_hf_config(load_hf_config(config))
    if config.is_file() and model_from_hf_config(load_hf_config(config)).tensors != model.tensors:
        raise ConversionError(
            f"{config} describes another model than model=; drop model= or the file"
        )
    return model


@beartype
def convert_torch_dist_to_hf(
    src_dir: _PathLike,
    dst_hf_dir: _PathLike,
    *,
    model: ModelSpec | None = None,
    trust_pickle: bool = False,
    drop_optimizer: bool = False,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ConvertSummary:
    """A Megatron-Core ``torch_dist`` checkpoint (saved under any strategy) -> an HF
    checkpoint, bitwise. ``src_dir`` is a directory Megatron-LM's ``--load`` reads (the
    checkpoint its ``latest_checkpointed_iteration.txt`` names) or the dist checkpoint
    itself. ``model`` defaults to ``src_dir/config.json`` (which our
    export carries; Megatron's own checkpoints need ``model``). ``trust_pickle`` and
    ``drop_optimizer``: see
    :func:`~areal_fn.runtime.checkpoint.megatron.import_megatron_checkpoint`. The
    parameters are held in memory once while the HF shards are written."""
    from areal_fn.plans.convert import iter_to_hf

    src, dst = Path(src_dir), Path(dst_hf_dir)
    start = time.perf_counter()
    model = _model_of(src, model)
    hf = read_hf_files(src, weights=_mcore_files(src), config=model.hf_config())
    check_overwrite(
        dst,
        overwrite=overwrite,
        owned=hf_owned(hf.names),
        kind="HF checkpoint",
        error=ConversionError,
    )
    state, layout = read_megatron_state(
        src, model, trust_pickle=trust_pickle, drop_optimizer=drop_optimizer
    )
    tally = Tally(progress)

    write_hf_checkpoint(
        dst,
        tally.count(iter_to_hf({0: state}, layout)),
        config=hf.config,
        model=model,
        files=hf.files,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )
    return ConvertSummary(
        path=str(dst),
        ranks=(),
        tensors=tally.tensors,
        bytes=tally.bytes,
        seconds=round(time.perf_counter() - start, 4),
        carried=hf.names,
        not_carried=tuple(f"{n} ({why})" for n, why in hf.skipped),
    )
