"""Saving a checkpoint, step by step (:func:`~areal_fn.runtime.checkpoint.api.save_checkpoint`).

Every step that can fail on one process ends in ``_Group.agree``, so all processes
raise together: check the request (``_plan``), check that every layout rank is passed
once (``_check_every_rank``), stage the pieces (``_stage``), build the manifest and
prepare the directory on the first process (``_prepare``), then write the DCP files,
each checksummed as it is written (:mod:`~areal_fn.runtime.checkpoint.writer`), and
commit (``_write``), in this thread or in the background.
"""

import functools
import io
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from areal_fn.errors import CheckpointError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import dtype_name
from areal_fn.plans.checkpoint.keyed import check_key, with_keyed_digest
from areal_fn.plans.checkpoint.manifest import (
    CheckpointManifest,
    FileDigest,
    OptimizerSpec,
    make_manifest,
    optim_key,
)
from areal_fn.plans.checkpoint.write import Dedup, WritePlan, plan_save
from areal_fn.runtime.checkpoint.dcp import (
    _identity,
    _owned,
    _piece_view,
    _Reshaped,
    _SavePlanner,
    _single_process_dcp,
    _to_bytes,
    _viewed,
    _write_item,
    dcp_error,
)
from areal_fn.runtime.checkpoint.files import (
    LATEST,
    MANIFEST,
    _data_files,
    _fsync_dir,
    _latest_name,
    _write_text_atomic,
    list_checkpoints,
    step_dir_name,
)
from areal_fn.runtime.checkpoint.hashing import SAVE_CHECKSUM, file_digest
from areal_fn.runtime.checkpoint.metadata import stored_items
from areal_fn.runtime.checkpoint.state import (
    _LR_KEY,
    _RNG_PREFIX,
    PendingSave,
    RankState,
    _check_states,
    _error,
    _Group,
)
from areal_fn.runtime.checkpoint.writer import DigestingWriter
from areal_fn.runtime.hf.files import HfFiles, write_checkpoint_hf_files
from areal_fn.sharding.box import Box

#: (parameter dtype, ((state, dtype), ...)) of a canonical tensor, as staged
_Dtypes = dict[str, tuple[str, tuple[tuple[str, str], ...]]]


@attrs.frozen(kw_only=True)
class _Request:
    """What :func:`~areal_fn.runtime.checkpoint.api.save_checkpoint` was asked for."""

    root: Path
    layout: Layout
    states: Mapping[int, RankState]
    model: ModelSpec
    allocation: str
    step: int
    opt: OptimizerSpec
    data_position: Any
    lr_scheduler: Mapping[str, Any] | None
    rng: dict[str, Any] | None
    keep: int
    dedup: Dedup
    process_group: "dist.ProcessGroup | None"
    blocking: bool
    thread_count: int
    hf: HfFiles | None
    hmac_key: bytes | None

    @property
    def name(self) -> str:
        return step_dir_name(self.step)

    @property
    def final(self) -> Path:
        return self.root / self.name

    @property
    def tmp(self) -> Path:
        return self.root / f".tmp-{self.name}"


@attrs.frozen
class _Staged:
    items: list[WriteItem]
    data: dict[MetadataIndex, Callable[[], Any]]
    dtypes: _Dtypes
    extras: list[str]


@attrs.frozen(kw_only=True)
class _Write:
    """What the write (in this thread or in the background) needs."""

    req: _Request
    distributed: bool
    group: _Group
    pg: "dist.ProcessGroup | None"
    staged: _Staged
    manifest: CheckpointManifest | None


# -- the steps, in order -------------------------------------------------------------


def _save(req: _Request) -> "Path | PendingSave":
    g = _Group(req.process_group)
    running = _PENDING.get(req.root.resolve())
    error: str | None = None
    plan: WritePlan | None = None
    extras: dict[str, bytes] = {}
    try:
        plan = _plan(req, running)
        extras = _extras(req, first=g.rank == 0)
    except (SpecError, TypeError, ValueError) as e:
        error = f"cannot save checkpoint {req.final}: {_error(e)}"
    g.agree(error)
    assert plan is not None
    _check_every_rank(g, req)
    staged: _Staged | None = None
    try:
        staged = _stage(plan, req.states, req.opt, extras, copy=not req.blocking)
    except SpecError as e:
        error = str(e)
    g.agree(error)
    assert staged is not None
    gathered = g.all_gather((staged.dtypes, staged.extras))
    manifest: CheckpointManifest | None = None
    if g.rank == 0:
        try:
            manifest = _prepare(req, plan, gathered)
        except (SpecError, OSError) as e:
            error = f"cannot save checkpoint {req.final}: {_error(e)}"
    g.agree(error)
    pg = _async_group(req.process_group) if not req.blocking and g.on else req.process_group
    job = _Write(req=req, distributed=g.on, group=g, pg=pg, staged=staged, manifest=manifest)
    return _write(job) if req.blocking else _in_background(job)


def _plan(req: _Request, running: PendingSave | None) -> WritePlan:
    """The write plan, once the request is found sound (``CheckpointError`` if not)."""
    if running is not None and not running.done():
        raise CheckpointError(
            f"a background save into {running.path} is still running; call its wait() first"
        )
    if req.keep < 1:
        raise CheckpointError(f"keep={req.keep} must be >= 1 (the checkpoint being saved is kept)")
    if req.step < 0:
        raise CheckpointError(f"step={req.step} must be >= 0")
    if req.thread_count < 1:
        raise CheckpointError(
            f"thread_count={req.thread_count} must be >= 1 (the data files each process "
            "writes at once)"
        )
    plan = plan_save(req.layout, dedup=req.dedup)
    _check_states(req.layout, req.states, req.opt)
    if req.hf is not None:
        _check_hf(req.hf, req.model)
    if req.hmac_key is not None:
        check_key(req.hmac_key)
    json.dumps(req.data_position)
    return plan


def _extras(req: _Request, *, first: bool) -> dict[str, bytes]:
    """The non-tensor entries this process writes: the LR scheduler (first), its RNG."""
    extras: dict[str, bytes] = {}
    if first and req.lr_scheduler is not None:
        extras[_LR_KEY] = _to_bytes(dict(req.lr_scheduler))
    if req.rng is not None:
        extras[f"{_RNG_PREFIX}{next(iter(req.states))}"] = _to_bytes(req.rng)
    return extras


def _check_every_rank(g: _Group, req: _Request) -> None:
    """``CheckpointError`` on every process unless each layout rank is passed exactly once."""
    layout = req.layout
    held = [r for rs in g.all_gather(sorted(req.states)) for r in rs]
    if sorted(held) != list(range(layout.world_size)):
        dup = sorted({r for r in held if held.count(r) > 1})
        miss = sorted(set(range(layout.world_size)) - set(held))
        raise CheckpointError(
            f"cannot save {req.final}: every rank of the {layout.kind} layout must be passed by exactly "
            f"one process; missing {miss}, passed twice {dup}"
        )


def _stage(
    plan: WritePlan,
    states: Mapping[int, RankState],
    opt: OptimizerSpec,
    extras: Mapping[str, bytes],
    *,
    copy: bool,
) -> _Staged:
    shapes = {c.name: c.shape for c in plan.canonical}
    chunks = plan.chunks()
    items: list[WriteItem] = []
    data: dict[MetadataIndex, Callable[[], Any]] = {}
    dtypes: _Dtypes = {}

    def add(key: str, box: Box, shape: tuple[int, ...], src: "torch.Tensor | _Reshaped") -> None:
        item = _write_item(key, box, shape, src.dtype)
        items.append(item)
        if copy:  # off the training path: later updates of src do not reach the checkpoint
            owned = (
                src.copy()
                if isinstance(src, _Reshaped)
                else src.detach().to("cpu", copy=True).contiguous()
            )
            data[item.index] = functools.partial(_identity, owned)
        elif isinstance(src, _Reshaped):  # copied when written, one piece at a time
            data[item.index] = src.copy
        else:
            data[item.index] = functools.partial(_owned, src)

    views = dict(plan.views)
    for r, st in sorted(states.items()):
        for p in plan.for_rank(r):
            src = _viewed(views, p.tensor, st.params[p.tensor], "parameter")
            add(p.canonical, p.box, shapes[p.canonical], _piece_view(src, p.local_box, p.box))
            sdt = []
            for m in opt.moments:
                t = _viewed(views, p.tensor, st.optim[p.tensor][m], f"{m} of")
                add(
                    optim_key(p.canonical, m),
                    p.box,
                    shapes[p.canonical],
                    _piece_view(t, p.local_box, p.box),
                )
                sdt.append((m, dtype_name(t.dtype)))
            for s in opt.scalars:
                t = st.optim[p.tensor][s]
                sdt.append((s, dtype_name(t.dtype)))
                if chunks[p.canonical][0] == (p.box, r):  # the first chunk's writer saves scalars
                    add(optim_key(p.canonical, s), Box(ranges=()), (), t.reshape(()))
            got = (dtype_name(src.dtype), tuple(sorted(sdt)))
            seen = dtypes.setdefault(p.canonical, got)
            if seen != got:
                raise CheckpointError(
                    f"{p.canonical}: rank {r} holds it as {got}, another piece as {seen}; every piece of a "
                    "tensor (and of each optimizer state) must have one dtype"
                )
    for key, blob in extras.items():
        item = WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
        items.append(item)
        data[item.index] = functools.partial(io.BytesIO, blob)
    return _Staged(items=items, data=data, dtypes=dtypes, extras=list(extras))


def _prepare(
    req: _Request, plan: WritePlan, gathered: list[tuple[_Dtypes, list[str]]]
) -> CheckpointManifest:
    """On the first process: the manifest (every process's dtypes agreeing), and the
    temporary directory made, with the HF files in it."""
    dtypes: _Dtypes = {}
    for d, _ in gathered:
        for k, v in d.items():
            if dtypes.setdefault(k, v) != v:
                raise CheckpointError(
                    f"{k} is held as {v} and as {dtypes[k]} on different ranks; every piece "
                    "of a tensor (and of each optimizer state) must have one dtype"
                )
    manifest = make_manifest(
        plan,
        allocation=req.allocation,
        model_config=req.hf.config_dict if req.hf is not None else req.model.hf_config(),
        step=req.step,
        optimizer=req.opt,
        dtypes={k: v[0] for k, v in dtypes.items()},
        state_dtypes={k: dict(v[1]) for k, v in dtypes.items()},
        data_position=req.data_position,
        extras=sorted(x for _, xs in gathered for x in xs),
        library_version=_library_version(),
    )
    _prepare_root(req.root, req.name, req.tmp)
    if req.hf is not None:
        write_checkpoint_hf_files(req.tmp, req.hf)
    return manifest


# -- writing (no type-checked calls: in the background, python's RNG is the training
# thread's, and beartype draws from it) ----------------------------------------------


def _write(job: _Write) -> Path:
    """Write the files (each checksummed as it is written), commit on the first process;
    every process agrees."""
    gw = _Group(job.pg) if job.distributed else job.group
    final = job.req.final
    err, written, digests = _write_files(job)
    everyone = gw.all_gather((err, digests))
    err = next((e for e, _ in everyone if e), None)
    if gw.rank == 0:
        err = _finish(job, err, [d for _, ds in everyone for d in ds], written)
    gw.agree(err if gw.rank == 0 else None)
    return final


def _write_files(job: _Write) -> tuple[str | None, Any, list[FileDigest]]:
    """DCP writes this process's items into the temporary directory; the error, if any,
    DCP's ``Metadata`` of what every process wrote (where each entry lies) and the
    checksum of each data file this process wrote."""
    req = job.req
    writer = DigestingWriter(req.tmp, thread_count=req.thread_count)
    try:
        with _single_process_dcp(job.distributed):
            written = dcp.save(
                {},
                storage_writer=writer,
                planner=_SavePlanner(job.staged.items, job.staged.data),
                process_group=job.pg,
                no_dist=not job.distributed,
            )
    except (Exception, CheckpointException) as e:  # DCP wraps what it raises in a BaseException
        return (
            f"cannot save checkpoint {req.final}: writing its files failed ({dcp_error(e)})",
            None,
            [],
        )
    digests = [
        FileDigest(path=name, size=size, algorithm=SAVE_CHECKSUM, digest=digest)
        for name, (size, digest) in sorted(writer.digests.items())
    ]
    return None, written, digests


def _digest_rest(tmp: Path, known: list[FileDigest]) -> list[FileDigest]:
    """Every file of ``tmp`` with its checksum: ``known`` (hashed as written), the others
    (DCP's ``.metadata``, ``hf/``: small) read, fsync'ed and hashed."""
    seen = {d.path for d in known}
    rest = [f for f in _data_files(tmp) if f not in seen]
    return known + [file_digest(tmp / f, f, SAVE_CHECKSUM, sync=True) for f in rest]


def _finish(job: _Write, err: str | None, digests: list[FileDigest], written: Any) -> str | None:
    """On the first process: commit (the manifest completed with every file's digest,
    where each entry lies, the keyed digest), or remove the temporary directory after an
    error."""
    req = job.req
    if err is not None:
        shutil.rmtree(req.tmp, ignore_errors=True)  # every process is done writing into it
        return err + (
            f"; {req.tmp} was removed and the checkpoints saved before are untouched; fix that "
            "(e.g. free disk space) and save again"
        )
    assert job.manifest is not None
    try:
        listed = tuple(sorted(_digest_rest(req.tmp, digests), key=lambda d: d.path))
        manifest = attrs.evolve(job.manifest, files=listed, storage=stored_items(written))
        if req.hmac_key is not None:
            manifest = with_keyed_digest(manifest, req.hmac_key)
        _commit(req.tmp, req.final, req.root, manifest, req.keep)
    except (SpecError, OSError) as e:
        return f"cannot commit checkpoint {req.final}: {_error(e)}"
    return None


def _in_background(job: _Write) -> PendingSave:
    """Start :func:`_write` in a thread; the :class:`PendingSave` that waits for it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _write(job)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name=f"checkpoint-{job.req.name}", daemon=True)
    thread.start()
    pending = PendingSave(job.req.final, thread, errors)
    _PENDING[job.req.root.resolve()] = pending
    return pending


# -- helpers -------------------------------------------------------------------------


def _check_hf(hf: HfFiles, model: ModelSpec) -> None:
    from areal_fn.model.spec import model_from_hf_config

    got = attrs.evolve(model_from_hf_config(hf.config_dict), dtype=model.dtype)
    if got != model:
        diff = [
            f"{a.name} {getattr(got, a.name)!r} != {getattr(model, a.name)!r}"
            for a in attrs.fields(ModelSpec)
            if getattr(got, a.name) != getattr(model, a.name)
        ]
        raise CheckpointError(
            f"hf.config describes another model than model= ({'; '.join(diff[:4])}); pass "
            "the config.json the model was built from, e.g. read_hf_files(<model dir>)"
        )


def _commit(tmp: Path, final: Path, root: Path, manifest: CheckpointManifest, keep: int) -> None:
    _write_text_atomic(tmp / MANIFEST, manifest.to_json())
    _fsync_dir(tmp)
    trash = root / f".trash-{final.name}"
    if final.exists():  # an orphan of an interrupted commit (never the latest: checked before)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)
    for _, old in list_checkpoints(root)[:-keep]:
        if old.name == final.name:
            continue
        gone = root / f".trash-{old.name}"
        os.replace(old, gone)  # atomic: a half-deleted checkpoint never looks like one
        shutil.rmtree(gone, ignore_errors=True)


def _prepare_root(root: Path, name: str, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if _latest_name(root) == name:
        raise CheckpointError(
            f"{root / name} is the latest checkpoint already; save under a new step, or load it instead"
        )
    for p in root.iterdir():  # leftovers of interrupted saves and deletions
        if p.name.startswith((".tmp-", ".trash-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    tmp.mkdir()


#: the latest background save per checkpoint root, in this process.
_PENDING: dict[Path, PendingSave] = {}


_ASYNC_GROUPS: dict[object, "dist.ProcessGroup"] = {}


def _async_group(pg: "dist.ProcessGroup | None") -> "dist.ProcessGroup":
    """A gloo group over the same ranks, for background saves (made once, collectively)."""
    key = pg if pg is not None else "world"
    if key not in _ASYNC_GROUPS:
        ranks = dist.get_process_group_ranks(pg) if pg is not None else None
        _ASYNC_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _ASYNC_GROUPS[key]


def _library_version() -> str:
    from areal_fn.version import __version__

    return __version__
