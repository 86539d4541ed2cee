"""Distributed checkpoints: canonical tensors in torch DCP storage, committed atomically.

Every rank writes the canonical boxes :func:`~areal_fn.plans.checkpoint.plan_save`
gives it (each element once, replicas deduplicated), as DCP chunks keyed by canonical
name (``model.layers.0.self_attn.q_proj.weight``) and ``optim/<canonical>/<state>``
for optimizer state; so any layout loads what any other layout saved. Next to DCP's
files sits ``manifest.json`` (:class:`~areal_fn.plans.checkpoint.CheckpointManifest`:
allocation, model config, tensors and chunks, optimizer, step, data position, BLAKE3
of every file, taken while it is written). Saved with ``hf=``, the model's
``config.json``, tokenizer and generation config sit in ``hf/``
(:mod:`~areal_fn.runtime.hf.files`). A save::

    root/.tmp-step-00000012/   DCP writes here (every file fsync'ed), then the manifest
    root/step-00000012/        one rename once complete (and the directory fsync'ed)
    root/latest                "step-00000012", replaced atomically last

so a crash (even ``kill -9``) at any moment leaves the previous checkpoint loadable and
untouched; older ones beyond ``keep`` are renamed away and deleted after the commit.
Loading verifies the manifest and every file's checksum before reading, never opens
a file for writing, and writes into the caller's local tensors in place. Nothing is
unpickled: DCP's read plan comes from the manifest, tensors are raw bytes
(docs/checkpoints.md, Security); ``trust_pickle`` is the opt-in for older checkpoints,
``hmac_key`` the check of which job saved one.

State is given per rank as :class:`RankState`: local tensors ``{name: tensor}`` as the
layout names them (for FSDP2 the DTensor locals) and optimizer state per local tensor
(``{name: {"exp_avg": t, "exp_avg_sq": t, "step": scalar}}``). Under ``torchrun`` each
process passes its own rank; without a process group one process may pass every rank
(offline conversion, tests).

The steps live in :mod:`~areal_fn.runtime.checkpoint.save` and
:mod:`~areal_fn.runtime.checkpoint.load`, the records (:class:`RankState`,
:class:`LoadResult`, :class:`PendingSave`) in :mod:`~areal_fn.runtime.checkpoint.state`;
import them from here.
"""

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.checkpoint.manifest import OptimizerSpec, optimizer_spec
from areal_fn.plans.checkpoint.write import Dedup
from areal_fn.runtime.checkpoint.files import (
    LATEST,
    MANIFEST,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.inspect import (
    CheckpointReader,
    cmd_checkpoint_export_hf,
    cmd_checkpoint_inspect,
    export_hf,
    inspect_checkpoint,
)
from areal_fn.runtime.checkpoint.load import _fill, _open, _read_plan, _result
from areal_fn.runtime.checkpoint.megatron import (
    export_megatron_checkpoint,
    import_megatron_checkpoint,
)
from areal_fn.runtime.checkpoint.save import _Request, _save
from areal_fn.runtime.checkpoint.state import (
    LoadResult,
    PendingSave,
    RankState,
    _Group,
    capture_rng,
    restore_rng,
)
from areal_fn.runtime.hf.files import (
    HfFiles,
    checkpoint_hf_files,
    read_hf_files,
)

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
    thread_count: int = 2,
    hf: HfFiles | None = None,
    hmac_key: bytes | None = None,
) -> "Path | PendingSave":
    """Save ``states`` (this process's ranks of ``layout``) as checkpoint ``root/step-<step>``.

    Collective over ``process_group`` (default: the world when initialised). Each
    layout rank must be passed by exactly one process. ``lr_scheduler`` and
    ``data_position`` (JSON-able) are taken from the first process; RNG states from
    every process that passes a single rank, as they were when the call began (the
    call leaves them as it found them). With ``blocking=False`` the state is copied
    first and a :class:`PendingSave` returned: call its ``wait()`` before the next
    save (distributed, the background write uses a gloo group of its own, made once).

    Each process writes ``thread_count`` data files at once, each by a thread of its
    own, and takes every file's BLAKE3 as it writes it (on one more thread per file,
    overlapped with the writing): no file is read back to be checksummed.

    ``hf`` (taken from the first process): the ``config.json`` the model was built from
    and the model directory's other non-weight files (tokenizer, generation config),
    e.g. ``read_hf_files(model_dir)`` or ``HfFiles.of_config(config)``. They are stored
    under ``hf/`` byte for byte (checksummed like every file), the manifest's model
    config is that ``config.json``, and :func:`export_hf` writes them back unchanged. It
    must describe ``model`` (its dtype aside), or ``CheckpointError``. Without ``hf`` the
    manifest holds ``model.hf_config()``, which lacks every key the spec does not model
    (token ids, ``transformers_version``, ...), and no tokenizer is kept.

    ``hmac_key`` (at least 16 bytes, e.g. a team's secret): the manifest also carries
    its HMAC-SHA256 under that key (``manifest_hmac``), which a load given the same key
    checks: proof that a job holding the key saved it (docs/checkpoints.md, Security).
    """
    entry_rng = capture_rng() if save_rng and len(states) == 1 else None
    python_rng = random.getstate()
    try:
        return _save(
            _Request(
                root=Path(root),
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
                hmac_key=hmac_key,
            )
        )
    finally:
        random.setstate(python_rng)  # type checks sample with python's RNG: undo that


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
    trust_pickle: bool = False,
    hmac_key: bytes | None = None,
) -> LoadResult:
    """Load a checkpoint into ``states`` (local tensors of ``layout``), in place.

    ``path`` is a checkpoint directory or a root with ``latest``. The manifest, the DCP
    metadata, every file's presence and size and (with ``verify``) checksum are checked
    first, the checksums shared among the processes of ``process_group``; any defect
    found there raises ``CheckpointError`` on every process, before any tensor is touched.
    Without ``verify`` a file whose bytes are damaged (its size intact) is found only while
    reading, if at all: ``CheckpointError`` on every process, saying that the local tensors
    may be partly overwritten. ``optimizer='none'`` loads parameters only. Dtypes must
    match the stored ones unless ``allow_cast``. Padding is zeroed.

    Nothing is unpickled: DCP's read plan comes from the manifest, tensors are read as
    raw bytes (or ``torch.load(weights_only=True)``), and a ``.metadata`` that is not
    plain DCP metadata is refused. A checkpoint saved before the manifest located its
    entries is read only with ``trust_pickle=True``, by unpickling its ``.metadata``:
    only for checkpoints you saved or trust. With ``hmac_key`` the manifest's keyed
    digest must match it (``CheckpointError`` otherwise, also when it has none).
    """
    g = _Group(process_group)
    opt = optimizer_spec(optimizer) if isinstance(optimizer, str) else optimizer
    opened = _open(
        g,
        path,
        layout=layout,
        states=states,
        opt=opt,
        verify=verify,
        allow_cast=allow_cast,
        trust_pickle=trust_pickle,
        hmac_key=hmac_key,
    )
    rp = _read_plan(
        opened, layout=layout, states=states, opt=opt, restore_rng_state=restore_rng_state
    )
    _fill(g, opened, rp, states, opt)
    return _result(opened, rp)
