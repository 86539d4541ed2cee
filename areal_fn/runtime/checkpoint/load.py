"""Loading a checkpoint, step by step (:func:`~areal_fn.runtime.checkpoint.api.load_checkpoint`).

``_open`` checks everything before any tensor is touched (manifest and its keyed
digest, model, optimizer, rank states, file sizes and checksums, the ``.metadata``
pickle, read by its opcodes only, dtypes), builds DCP's metadata from the manifest
(never unpickling anything unless ``trust_pickle`` for a checkpoint saved before the
manifest located its entries) and plans each rank's reads; ``_read_plan`` turns the
plans into DCP read items; ``_fill`` reads them into the caller's tensors, zeroes padding and sets scalar states; ``_result`` restores the
RNG and says what was loaded. Each step that can fail on one process ends in
``_Group.agree``, so all processes raise together.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from areal_fn.errors import CheckpointError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.tensor_spec import dtype_name, torch_dtype
from areal_fn.plans.checkpoint.keyed import check_keyed_digest
from areal_fn.plans.checkpoint.manifest import (
    CheckpointManifest,
    OptimizerSpec,
    check_model,
    check_optimizer,
    optim_key,
)
from areal_fn.plans.checkpoint.read import LoadPlan as PieceLoadPlan
from areal_fn.plans.checkpoint.read import plan_load
from areal_fn.runtime.checkpoint.dcp import (
    _ChunkReader,
    _from_bytes,
    _LoadPlanner,
    _piece_view,
    _read_into,
    _Reshaped,
    _single_process_dcp,
    _viewed,
    dcp_error,
)
from areal_fn.runtime.checkpoint.files import (
    _verify_files,
    check_sizes,
    read_manifest,
    resolve_checkpoint,
)
from areal_fn.runtime.checkpoint.metadata import dcp_metadata
from areal_fn.runtime.checkpoint.state import (
    _LR_KEY,
    _RNG_PREFIX,
    LoadResult,
    RankState,
    _check_states,
    _error,
    _Group,
    restore_rng,
)
from areal_fn.sharding.box import Box

#: said when a load fails after it began writing into the caller's tensors
_PARTLY = (
    "the local tensors may be partly overwritten: load them again before using them "
    "(verify=True checks every file's checksum before any tensor is touched)"
)


#: (local tensor, canonical, scalar state) -> the value read
_Scalars = dict[tuple[str, str, str], torch.Tensor]


@attrs.frozen(kw_only=True)
class _Opened:
    """A checkpoint found sound for ``states``, and each rank's reads."""

    folder: Path
    manifest: CheckpointManifest
    reader: _ChunkReader
    plans: dict[int, PieceLoadPlan]


@attrs.frozen(kw_only=True)
class _ReadPlan:
    """The DCP planner of one load, and where each rank's scalar states are read to."""

    planner: _LoadPlanner
    scalars: dict[int, _Scalars]
    #: the rank whose RNG state is restored (None: none is)
    own: int | None


def _open(
    g: _Group,
    path: "str | os.PathLike[str]",
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    opt: OptimizerSpec,
    verify: bool,
    allow_cast: bool,
    trust_pickle: bool,
    hmac_key: bytes | None,
) -> _Opened:
    """Every check before a tensor is touched, agreed by every process; the reads planned."""
    error: str | None = None
    folder = Path(path)
    plans: dict[int, PieceLoadPlan] = {}
    manifest: CheckpointManifest | None = None
    reader: _ChunkReader | None = None
    try:
        folder = resolve_checkpoint(path)
        manifest = read_manifest(folder)
        source = str(folder)
        if hmac_key is not None:
            check_keyed_digest(manifest, hmac_key, source=source)
        check_model(manifest, layout.canonical, source=source)
        check_optimizer(manifest, opt, source=source)
        _check_states(layout, states, opt)
        check_sizes(folder, manifest)
        if verify:
            _verify_files(folder, manifest, slice(g.rank, None, g.size))
        metadata = dcp_metadata(folder, manifest, trust_pickle=trust_pickle)
        reader = _ChunkReader(folder, metadata=metadata)
        if not allow_cast:
            _check_dtypes(manifest, layout, states, opt)
        plans = {r: plan_load(manifest, layout, r) for r in states}
    except (SpecError, OSError) as e:
        error = f"cannot load checkpoint {folder}: {_error(e)}"
    g.agree(error)
    assert manifest is not None and reader is not None
    return _Opened(folder=folder, manifest=manifest, reader=reader, plans=plans)


def _read_plan(
    op: _Opened,
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    opt: OptimizerSpec,
    restore_rng_state: bool,
) -> _ReadPlan:
    """Read items for every piece, scalar and wanted extra (LR scheduler, RNG state)."""
    items: list[ReadItem] = []
    dests: list[torch.Tensor | _Reshaped] = []
    scalars: dict[int, _Scalars] = {}
    for r, plan in op.plans.items():
        scalars[r] = {}
        _read_items(plan, states[r], opt, items, dests, scalars[r])
        _read_padding_scalars(layout, plan, states[r], opt, items, dests, scalars[r])
    # RNG states are per process: restored when each process loads one rank of a world
    # as large as the one that saved.
    own = (
        next(iter(states))
        if len(states) == 1 and op.manifest.world_size == layout.world_size
        else None
    )
    blobs = [
        k
        for k in op.manifest.extras
        if k == _LR_KEY or (restore_rng_state and k == f"{_RNG_PREFIX}{own}")
    ]
    for k in blobs:
        items.append(
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(k),
                dest_offsets=torch.Size([0]),
                storage_index=MetadataIndex(k),
                storage_offsets=torch.Size([0]),
                lengths=torch.Size([0]),
            )
        )
    planner = _LoadPlanner(items, dests, str(op.folder))
    return _ReadPlan(planner=planner, scalars=scalars, own=own)


def _fill(
    g: _Group, op: _Opened, rp: _ReadPlan, states: Mapping[int, RankState], opt: OptimizerSpec
) -> None:
    """Read into the caller's tensors, zero padding, set scalars; agreed by every process."""
    error: str | None = None
    reader = op.reader
    with torch.no_grad():
        try:
            with _single_process_dcp(False):
                dcp.load({}, storage_reader=reader, planner=rp.planner, no_dist=True)
            for r, plan in op.plans.items():
                st = states[r]
                views = dict(plan.views)
                for pad in plan.padding:
                    reader.touched = True
                    param = _viewed(views, pad.tensor, st.params[pad.tensor], "parameter")
                    param[pad.local_box.slices()].zero_()
                    for m in opt.moments:
                        state = _viewed(views, pad.tensor, st.optim[pad.tensor][m], f"{m} of")
                        state[pad.local_box.slices()].zero_()
                reader.touched = True
                _set_scalars(st, opt, rp.scalars[r], str(op.folder))
        except (Exception, CheckpointException) as e:  # DCP wraps what it raises in a BaseException
            error = f"cannot load checkpoint {op.folder}: {dcp_error(e)}"
            if reader.touched:
                error += f"; {_PARTLY}"
    g.agree(error)


def _result(op: _Opened, rp: _ReadPlan) -> LoadResult:
    """Restore this process's RNG state (when read); what the load restored."""
    blobs, folder = rp.planner.blobs, op.folder
    lr = _from_bytes(blobs[_LR_KEY], f"{folder}: {_LR_KEY}") if _LR_KEY in blobs else None
    rng_key = f"{_RNG_PREFIX}{rp.own}"
    restored = False
    if rng_key in blobs:
        restore_rng(_from_bytes(blobs[rng_key], f"{folder}: {rng_key}"))
        restored = True
    return LoadResult(
        path=folder,
        manifest=op.manifest,
        step=op.manifest.step,
        data_position=json.loads(op.manifest.data_position),
        lr_scheduler=lr,
        rng_restored=restored,
    )


# -- helpers -------------------------------------------------------------------------


def _read_items(
    plan: PieceLoadPlan,
    st: RankState,
    opt: OptimizerSpec,
    items: list[ReadItem],
    dests: list[torch.Tensor | _Reshaped],
    scalars: dict[tuple[str, str, str], torch.Tensor],
) -> None:
    views = dict(plan.views)
    for rp in plan.reads:
        param = _viewed(views, rp.tensor, st.params[rp.tensor], "parameter")
        _read_into(
            items, dests, rp.canonical, rp.box, rp.chunk, _piece_view(param, rp.local_box, rp.box)
        )
        for m in opt.moments:
            state = _viewed(views, rp.tensor, st.optim[rp.tensor][m], f"{m} of")
            view = _piece_view(state, rp.local_box, rp.box)
            _read_into(items, dests, optim_key(rp.canonical, m), rp.box, rp.chunk, view)
        for s in opt.scalars:
            k = (rp.tensor, rp.canonical, s)
            if k not in scalars:
                scalars[k] = torch.empty((), dtype=st.optim[rp.tensor][s].dtype)
                scalar = Box(ranges=())
                _read_into(items, dests, optim_key(rp.canonical, s), scalar, scalar, scalars[k])


def _read_padding_scalars(
    layout: Layout,
    plan: PieceLoadPlan,
    st: RankState,
    opt: OptimizerSpec,
    items: list[ReadItem],
    dests: list[torch.Tensor | _Reshaped],
    scalars: dict[tuple[str, str, str], torch.Tensor],
) -> None:
    """The optimizer's scalars (Adam's ``step``) of local tensors that are all padding on
    this rank (a vocabulary shard past the last token): no read carries them, so they are
    read from the canonical tensor the logical tensor holds elsewhere."""
    if not opt.scalars:
        return
    read = {rp.tensor for rp in plan.reads}
    for name in dict.fromkeys(pad.tensor for pad in plan.padding):
        if name in read:
            continue
        held = [
            t for t in layout.tensors if t.name == name and t.is_present(plan.rank) and t.fusion
        ]
        if not held:
            continue
        canonical = held[0].fusion[0].canonical
        for s in opt.scalars:
            k = (name, canonical, s)
            scalars[k] = torch.empty((), dtype=st.optim[name][s].dtype)
            scalar = Box(ranges=())
            _read_into(items, dests, optim_key(canonical, s), scalar, scalar, scalars[k])


def _check_dtypes(
    manifest: CheckpointManifest,
    layout: Layout,
    states: Mapping[int, RankState],
    opt: OptimizerSpec,
) -> None:
    saved = {t.name: t for t in manifest.tensors}
    for r, st in sorted(states.items()):
        for lt in layout.local_tensors(r):
            names = {p.canonical for p in lt.pieces if p.canonical is not None}
            for c in sorted(names):
                t = saved[c]
                pairs = [("parameter", t.dtype, st.params[lt.name].dtype)]
                sd = dict(t.state_dtypes)
                pairs += [(s.name, sd[s.name], st.optim[lt.name][s.name].dtype) for s in opt.states]
                for what, want, have in pairs:
                    if torch_dtype(want) != have:
                        raise CheckpointError(
                            f"{c} {what} is stored as {want}, rank {r}'s {lt.name} is {dtype_name(have)}; "
                            "pass allow_cast=True to cast explicitly"
                        )


def _set_scalars(
    st: RankState,
    opt: OptimizerSpec,
    read: Mapping[tuple[str, str, str], torch.Tensor],
    source: str,
) -> None:
    by_tensor: dict[tuple[str, str], list[tuple[str, torch.Tensor]]] = {}
    for (tensor, canonical, s), v in read.items():
        by_tensor.setdefault((tensor, s), []).append((canonical, v))
    for (tensor, s), values in by_tensor.items():
        first_c, first = values[0]
        for c, v in values[1:]:
            if not torch.equal(v, first):
                raise CheckpointError(
                    f"{source}: {tensor} fuses {first_c} ({s}={first.item()}) and {c} ({s}={v.item()}); "
                    "a fused local tensor needs one value"
                )
        dest = st.optim[tensor][s]
        dest.copy_(first.reshape(dest.shape))
