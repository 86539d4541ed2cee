"""Distributed checkpoints: canonical tensors in torch DCP storage, committed atomically.

Every rank writes the canonical boxes :func:`~areal_fn.plans.checkpoint.plan_save`
gives it (each element once, replicas deduplicated), as DCP chunks keyed by canonical
name (``model.layers.0.self_attn.q_proj.weight``) and ``optim/<canonical>/<state>``
for optimizer state; so any layout loads what any other layout saved. Next to DCP's
files sits ``manifest.json`` (:class:`~areal_fn.plans.checkpoint.CheckpointManifest`:
allocation, model config, tensors and chunks, optimizer, step, data position, sha256
of every file). Saved with ``hf=``, the model's ``config.json``, tokenizer and
generation config sit in ``hf/`` (:mod:`~areal_fn.runtime.hf.files`). A save::

    root/.tmp-step-00000012/   DCP writes here (every file fsync'ed), then the manifest
    root/step-00000012/        one rename once complete (and the directory fsync'ed)
    root/latest                "step-00000012", replaced atomically last

so a crash (even ``kill -9``) at any moment leaves the previous checkpoint loadable and
untouched; older ones beyond ``keep`` are renamed away and deleted after the commit.
Loading verifies the manifest and every file's checksum before reading, never opens
a file for writing, and writes into the caller's local tensors in place.

State is given per rank as :class:`RankState`: local tensors ``{name: tensor}`` as the
layout names them (for FSDP2 the DTensor locals) and optimizer state per local tensor
(``{name: {"exp_avg": t, "exp_avg_sq": t, "step": scalar}}``). Under ``torchrun`` each
process passes its own rank; without a process group one process may pass every rank
(offline conversion, tests).
"""

import functools
import io
import json
import os
import random
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    WriteItem,
    WriteItemType,
)

from areal_fn.errors import CheckpointError, SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import dtype_name, torch_dtype
from areal_fn.plans.checkpoint import (
    CheckpointManifest,
    Dedup,
    FileDigest,
    OptimizerSpec,
    WritePlan,
    check_model,
    check_optimizer,
    make_manifest,
    optim_key,
    optimizer_spec,
    plan_load,
    plan_save,
)
from areal_fn.plans.checkpoint import (
    LoadPlan as PieceLoadPlan,
)
from areal_fn.runtime.checkpoint.dcp import (
    _ChunkReader,
    _from_bytes,
    _identity,
    _LoadPlanner,
    _owned,
    _piece_view,
    _SavePlanner,
    _single_process_dcp,
    _to_bytes,
    _write_item,
    dcp_error,
)
from areal_fn.runtime.checkpoint.files import (
    LATEST,
    MANIFEST,
    _check_sizes,
    _data_files,
    _digest,
    _fsync_dir,
    _latest_name,
    _verify_files,
    _write_text_atomic,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    step_dir_name,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.inspect import (
    CheckpointReader,
    cmd_checkpoint_export_hf,
    cmd_checkpoint_inspect,
    export_hf,
    inspect_checkpoint,
)
from areal_fn.runtime.checkpoint.megatron import (
    export_megatron_checkpoint,
    import_megatron_checkpoint,
)
from areal_fn.runtime.hf.files import (
    HfFiles,
    checkpoint_hf_files,
    read_hf_files,
    write_checkpoint_hf_files,
)
from areal_fn.sharding.box import Box

__all__ = [
    "LATEST",
    "MANIFEST",
    "CheckpointReader",
    "HfFiles",
    "LoadResult",
    "PendingSave",
    "RankState",
    "capture_rng",
    "checkpoint_hf_files",
    "cmd_checkpoint_export_hf",
    "cmd_checkpoint_inspect",
    "export_hf",
    "export_megatron_checkpoint",
    "import_megatron_checkpoint",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_hf_files",
    "read_manifest",
    "resolve_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "verify_checkpoint",
]

_LR_KEY = "train/lr_scheduler"
_RNG_PREFIX = "rng/"


@attrs.define(kw_only=True)
class RankState:
    """One rank's local tensors and optimizer state (tensors live here, not in records)."""

    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class LoadResult:
    """What a load restored besides the tensors."""

    path: Path
    manifest: CheckpointManifest
    step: int
    data_position: Any
    lr_scheduler: dict[str, Any] | None
    rng_restored: bool


# -- process group -------------------------------------------------------------------


class _Group:
    """The processes taking part (none: this process alone)."""

    def __init__(self, pg: "dist.ProcessGroup | None") -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.pg = pg
        self.rank = dist.get_rank(pg) if self.on else 0
        self.size = dist.get_world_size(pg) if self.on else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, error: str | None) -> None:
        """Raise the first process's error on every process (nobody hangs alone)."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])


def _error(e: BaseException) -> str:
    return str(e) if isinstance(e, SpecError) else f"{type(e).__name__}: {e}"


#: said when a load fails after it began writing into the caller's tensors
_PARTLY = (
    "the local tensors may be partly overwritten: load them again before using them "
    "(verify=True checks every file's sha256 before any tensor is touched)"
)


# -- rng -----------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU, and CUDA when present) RNG states."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- state checks --------------------------------------------------------------------


def _check_states(layout: Layout, states: Mapping[int, RankState], opt: OptimizerSpec) -> None:
    problems: list[str] = []
    for r, st in sorted(states.items()):
        if not 0 <= r < layout.world_size:
            raise CheckpointError(
                f"rank {r} is outside the {layout.kind} layout's {layout.world_size} ranks"
            )
        want = {lt.name: lt for lt in layout.local_tensors(r)}
        have = st.params
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        shapes = [
            f"{n} {tuple(have[n].shape)} != {want[n].shape}"
            for n in want
            if n in have and tuple(have[n].shape) != want[n].shape
        ]
        if missing:
            problems.append(f"rank {r} lacks local tensors {missing[:4]}")
        if extra:
            problems.append(f"rank {r} has tensors the layout does not: {extra[:4]}")
        if shapes:
            problems.append(f"rank {r} mis-shaped {shapes[:4]}")
        if opt.name == "none":
            if st.optim:
                problems.append(
                    f"rank {r} passes optimizer state but optimizer='none'; name the optimizer (e.g. 'adam')"
                )
            continue
        for n, lt in want.items():
            s = st.optim.get(n)
            if s is None:
                problems.append(f"rank {r}: no {opt.name} state for {n}")
                continue
            names = tuple(x.name for x in opt.states)
            if set(s) != set(names):
                problems.append(
                    f"rank {r}: {n} has optimizer states {sorted(s)}, {opt} needs {list(names)}"
                )
                continue
            for x in opt.states:
                shape = tuple(s[x.name].shape)
                if x.kind == "moment" and shape != lt.shape:
                    problems.append(
                        f"rank {r}: {n} {x.name} has shape {shape}, the parameter {lt.shape}"
                    )
                if x.kind == "scalar" and s[x.name].numel() != 1:
                    problems.append(
                        f"rank {r}: {n} {x.name} has shape {shape}, a scalar is expected"
                    )
        extra_opt = [n for n in st.optim if n not in want]
        if extra_opt:
            problems.append(f"rank {r} has optimizer state for unknown tensors {extra_opt[:4]}")
    if problems:
        raise CheckpointError(
            f"local states do not match the {layout.kind} layout: " + "; ".join(problems[:8])
        )


# -- save ----------------------------------------------------------------------------


@attrs.frozen
class _Staged:
    items: list[WriteItem]
    data: dict[MetadataIndex, Callable[[], Any]]
    dtypes: dict[str, tuple[str, tuple[tuple[str, str], ...]]]
    extras: list[str]


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
    dtypes: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}

    def add(key: str, box: Box, shape: tuple[int, ...], src: torch.Tensor) -> None:
        item = _write_item(key, box, shape, src.dtype)
        items.append(item)
        if copy:  # off the training path: later updates of src do not reach the checkpoint
            owned = src.detach().to("cpu", copy=True).contiguous()
            data[item.index] = functools.partial(_identity, owned)
        else:
            data[item.index] = functools.partial(_owned, src)

    for r, st in sorted(states.items()):
        for p in plan.for_rank(r):
            src = st.params[p.tensor]
            add(p.canonical, p.box, shapes[p.canonical], _piece_view(src, p.local_box, p.box))
            sdt = []
            for m in opt.moments:
                t = st.optim[p.tensor][m]
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


@attrs.define
class PendingSave:
    """An asynchronous save: state was copied; writing and commit run in the background."""

    path: Path
    _thread: threading.Thread
    _error: list[BaseException]

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until committed; raise what the save raised."""
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self.path


def save_checkpoint(
    root: "str | os.PathLike[str]",
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    model: ModelSpec,
    allocation: str,
    step: int,
    optimizer: "str | OptimizerSpec" = "none",
    data_position: Any = None,
    lr_scheduler: Mapping[str, Any] | None = None,
    save_rng: bool = True,
    keep: int = 3,
    dedup: Dedup = "balanced",
    process_group: "dist.ProcessGroup | None" = None,
    blocking: bool = True,
    thread_count: int = 1,
    hf: HfFiles | None = None,
) -> "Path | PendingSave":
    """Save ``states`` (this process's ranks of ``layout``) as checkpoint ``root/step-<step>``.

    Collective over ``process_group`` (default: the world when initialised). Each
    layout rank must be passed by exactly one process. ``lr_scheduler`` and
    ``data_position`` (JSON-able) are taken from the first process; RNG states from
    every process that passes a single rank, as they were when the call began (the
    call leaves them as it found them). With ``blocking=False`` the state is copied
    first and a :class:`PendingSave` returned: call its ``wait()`` before the next
    save (distributed, the background write uses a gloo group of its own, made once).

    ``hf`` (taken from the first process): the ``config.json`` the model was built from
    and the model directory's other non-weight files (tokenizer, generation config),
    e.g. ``read_hf_files(model_dir)`` or ``HfFiles.of_config(config)``. They are stored
    under ``hf/`` byte for byte (checksummed like every file), the manifest's model
    config is that ``config.json``, and :func:`export_hf` writes them back unchanged. It
    must describe ``model`` (its dtype aside), or ``CheckpointError``. Without ``hf`` the
    manifest holds ``model.hf_config()``, which lacks every key the spec does not model
    (token ids, ``transformers_version``, ...), and no tokenizer is kept.
    """
    entry_rng = capture_rng() if save_rng and len(states) == 1 else None
    python_rng = random.getstate()
    try:
        return _save(
            Path(root),
            layout=layout,
            states=states,
            model=model,
            allocation=allocation,
            step=step,
            opt=optimizer_spec(optimizer) if isinstance(optimizer, str) else optimizer,
            data_position=data_position,
            lr_scheduler=lr_scheduler,
            rng=entry_rng,
            keep=keep,
            dedup=dedup,
            process_group=process_group,
            blocking=blocking,
            thread_count=thread_count,
            hf=hf,
        )
    finally:
        random.setstate(python_rng)  # type checks sample with python's RNG: undo that


def _save(
    root: Path,
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    model: ModelSpec,
    allocation: str,
    step: int,
    opt: OptimizerSpec,
    data_position: Any,
    lr_scheduler: Mapping[str, Any] | None,
    rng: dict[str, Any] | None,
    keep: int,
    dedup: Dedup,
    process_group: "dist.ProcessGroup | None",
    blocking: bool,
    thread_count: int,
    hf: HfFiles | None,
) -> "Path | PendingSave":
    g = _Group(process_group)
    name = step_dir_name(step)
    final = root / name
    running = _PENDING.get(root.resolve())
    tmp = root / f".tmp-{name}"
    error: str | None = None
    plan: WritePlan | None = None
    extras: dict[str, bytes] = {}
    try:
        if running is not None and not running.done():
            raise CheckpointError(
                f"a background save into {running.path} is still running; call its wait() first"
            )
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be >= 1 (the checkpoint being saved is kept)")
        if step < 0:
            raise CheckpointError(f"step={step} must be >= 0")
        plan = plan_save(layout, dedup=dedup)
        _check_states(layout, states, opt)
        if hf is not None:
            _check_hf(hf, model)
        json.dumps(data_position)
        if g.rank == 0 and lr_scheduler is not None:
            extras[_LR_KEY] = _to_bytes(dict(lr_scheduler))
        if rng is not None:
            extras[f"{_RNG_PREFIX}{next(iter(states))}"] = _to_bytes(rng)
    except (SpecError, TypeError, ValueError) as e:
        error = f"cannot save checkpoint {final}: {_error(e)}"
    g.agree(error)
    assert plan is not None
    held = [r for rs in g.all_gather(sorted(states)) for r in rs]
    if sorted(held) != list(range(layout.world_size)):
        dup = sorted({r for r in held if held.count(r) > 1})
        miss = sorted(set(range(layout.world_size)) - set(held))
        raise CheckpointError(
            f"cannot save {final}: every rank of the {layout.kind} layout must be passed by exactly "
            f"one process; missing {miss}, passed twice {dup}"
        )
    staged: _Staged | None = None
    try:
        staged = _stage(plan, states, opt, extras, copy=not blocking)
    except SpecError as e:
        error = str(e)
    g.agree(error)
    assert staged is not None
    gathered = g.all_gather((staged.dtypes, staged.extras))
    manifest: CheckpointManifest | None = None
    if g.rank == 0:
        try:
            dtypes: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
            for d, _ in gathered:
                for k, v in d.items():
                    if dtypes.setdefault(k, v) != v:
                        raise CheckpointError(
                            f"{k} is held as {v} and as {dtypes[k]} on different ranks; every piece "
                            "of a tensor (and of each optimizer state) must have one dtype"
                        )
            manifest = make_manifest(
                plan,
                allocation=allocation,
                model_config=hf.config_dict if hf is not None else model.hf_config(),
                step=step,
                optimizer=opt,
                dtypes={k: v[0] for k, v in dtypes.items()},
                state_dtypes={k: dict(v[1]) for k, v in dtypes.items()},
                data_position=data_position,
                extras=sorted(x for _, xs in gathered for x in xs),
                library_version=_library_version(),
            )
            _prepare_root(root, name, tmp)
            if hf is not None:
                write_checkpoint_hf_files(tmp, hf)
        except (SpecError, OSError) as e:
            error = f"cannot save checkpoint {final}: {_error(e)}"
    g.agree(error)
    pg = _async_group(process_group) if not blocking and g.on else process_group

    def write() -> Path:
        # No type-checked (beartype) calls here: they draw from python's RNG, which the
        # training thread owns while a save runs in the background.
        gw = _Group(pg) if g.on else g
        err: str | None = None
        digests: list[FileDigest] = []
        try:
            with _single_process_dcp(g.on):
                dcp.save(
                    {},
                    storage_writer=FileSystemWriter(
                        tmp, single_file_per_rank=True, sync_files=True, thread_count=thread_count
                    ),
                    planner=_SavePlanner(staged.items, staged.data),
                    process_group=pg,
                    no_dist=not g.on,
                )
        except (Exception, CheckpointException) as e:  # DCP wraps what it raises in a BaseException
            err = f"cannot save checkpoint {final}: writing its files failed ({dcp_error(e)})"
        try:
            if err is None:
                files = _data_files(tmp)
                mine = files[gw.rank :: gw.size]
                with ThreadPoolExecutor(max_workers=max(1, min(4, len(mine)))) as pool:
                    digests = list(pool.map(lambda f: _digest(tmp / f, f, sync=True), mine))
        except OSError as e:
            err = f"cannot save checkpoint {final}: {e}"
        everyone = gw.all_gather((err, digests))
        err = next((e for e, _ in everyone if e), None)
        if gw.rank == 0 and err is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # every process is done writing into it
            err += (
                f"; {tmp} was removed and the checkpoints saved before are untouched; fix that "
                "(e.g. free disk space) and save again"
            )
        if gw.rank == 0 and err is None:
            assert manifest is not None
            try:
                listed = sorted((d for _, ds in everyone for d in ds), key=lambda d: d.path)
                _commit(tmp, final, root, attrs.evolve(manifest, files=tuple(listed)), keep)
            except (SpecError, OSError) as e:
                err = f"cannot commit checkpoint {final}: {_error(e)}"
        gw.agree(err if gw.rank == 0 else None)
        return final

    if blocking:
        return write()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            write()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name=f"checkpoint-{name}", daemon=True)
    thread.start()
    pending = PendingSave(final, thread, errors)
    _PENDING[root.resolve()] = pending
    return pending


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


# -- load ----------------------------------------------------------------------------


def _read_items(
    plan: PieceLoadPlan,
    st: RankState,
    opt: OptimizerSpec,
    items: list[ReadItem],
    dests: list[torch.Tensor],
    scalars: dict[tuple[str, str, str], torch.Tensor],
) -> None:
    def add(key: str, box: Box, chunk: Box, dest: torch.Tensor) -> None:
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, box.start, index=len(dests)),
                dest_offsets=torch.Size([0] * box.ndim),
                storage_index=MetadataIndex(key, chunk.start),
                storage_offsets=torch.Size(
                    b - c for b, c in zip(box.start, chunk.start, strict=True)
                ),
                lengths=torch.Size(box.shape),
            )
        )
        dests.append(dest)

    for rp in plan.reads:
        add(rp.canonical, rp.box, rp.chunk, _piece_view(st.params[rp.tensor], rp.local_box, rp.box))
        for m in opt.moments:
            view = _piece_view(st.optim[rp.tensor][m], rp.local_box, rp.box)
            add(optim_key(rp.canonical, m), rp.box, rp.chunk, view)
        for s in opt.scalars:
            k = (rp.tensor, rp.canonical, s)
            if k not in scalars:
                scalars[k] = torch.empty((), dtype=st.optim[rp.tensor][s].dtype)
                add(optim_key(rp.canonical, s), Box(ranges=()), Box(ranges=()), scalars[k])


def load_checkpoint(
    path: "str | os.PathLike[str]",
    *,
    layout: Layout,
    states: Mapping[int, RankState],
    optimizer: "str | OptimizerSpec" = "none",
    restore_rng_state: bool = True,
    verify: bool = True,
    allow_cast: bool = False,
    process_group: "dist.ProcessGroup | None" = None,
) -> LoadResult:
    """Load a checkpoint into ``states`` (local tensors of ``layout``), in place.

    ``path`` is a checkpoint directory or a root with ``latest``. The manifest, the DCP
    metadata, every file's presence and size and (with ``verify``) sha256 are checked
    first, the checksums shared among the processes of ``process_group``; any defect
    found there raises ``CheckpointError`` on every process, before any tensor is touched.
    Without ``verify`` a file whose bytes are damaged (its size intact) is found only while
    reading, if at all: ``CheckpointError`` on every process, saying that the local tensors
    may be partly overwritten. ``optimizer='none'`` loads parameters only. Dtypes must
    match the stored ones unless ``allow_cast``. Padding is zeroed.
    """
    g = _Group(process_group)
    opt = optimizer_spec(optimizer) if isinstance(optimizer, str) else optimizer
    error: str | None = None
    folder = Path(path)
    plans: dict[int, PieceLoadPlan] = {}
    manifest: CheckpointManifest | None = None
    reader: _ChunkReader | None = None
    try:
        folder = resolve_checkpoint(path)
        manifest = read_manifest(folder)
        source = str(folder)
        check_model(manifest, layout.canonical, source=source)
        check_optimizer(manifest, opt, source=source)
        _check_states(layout, states, opt)
        _check_sizes(folder, manifest)
        if verify:
            _verify_files(folder, manifest, slice(g.rank, None, g.size))
        reader = _ChunkReader(folder)
        reader.read_metadata()  # a damaged .metadata is refused here, before any read
        if not allow_cast:
            _check_dtypes(manifest, layout, states, opt)
        plans = {r: plan_load(manifest, layout, r) for r in states}
    except (SpecError, OSError) as e:
        error = f"cannot load checkpoint {folder}: {_error(e)}"
    g.agree(error)
    assert manifest is not None and reader is not None
    items: list[ReadItem] = []
    dests: list[torch.Tensor] = []
    scalars: dict[int, dict[tuple[str, str, str], torch.Tensor]] = {}
    for r, plan in plans.items():
        scalars[r] = {}
        _read_items(plan, states[r], opt, items, dests, scalars[r])
    # RNG states are per process: restored when each process loads one rank of a world
    # as large as the one that saved.
    own = (
        next(iter(states))
        if len(states) == 1 and manifest.world_size == layout.world_size
        else None
    )
    blobs = [
        k
        for k in manifest.extras
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
    planner = _LoadPlanner(items, dests, str(folder))
    with torch.no_grad():
        try:
            with _single_process_dcp(False):
                dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
            for r, plan in plans.items():
                st = states[r]
                for pad in plan.padding:
                    reader.touched = True
                    st.params[pad.tensor][pad.local_box.slices()].zero_()
                    for m in opt.moments:
                        st.optim[pad.tensor][m][pad.local_box.slices()].zero_()
                reader.touched = True
                _set_scalars(st, opt, scalars[r], str(folder))
        except (Exception, CheckpointException) as e:  # DCP wraps what it raises in a BaseException
            error = f"cannot load checkpoint {folder}: {dcp_error(e)}"
            if reader.touched:
                error += f"; {_PARTLY}"
    g.agree(error)
    lr = (
        _from_bytes(planner.blobs[_LR_KEY], f"{folder}: {_LR_KEY}")
        if _LR_KEY in planner.blobs
        else None
    )
    rng_key = f"{_RNG_PREFIX}{own}"
    restored = False
    if rng_key in planner.blobs:
        restore_rng(_from_bytes(planner.blobs[rng_key], f"{folder}: {rng_key}"))
        restored = True
    return LoadResult(
        path=folder,
        manifest=manifest,
        step=manifest.step,
        data_position=json.loads(manifest.data_position),
        lr_scheduler=lr,
        rng_restored=restored,
    )


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
