"""What a checkpoint says about itself, and whether it fits a model and an optimizer.

:class:`CheckpointManifest` (``manifest.json``): allocation, model config, canonical
tensors with their chunks and writers, optimizer, step, data position, a checksum of
every file (:class:`~areal_fn.plans.checkpoint.storage.FileDigest`, the algorithm
named), where each DCP entry lies in them (``storage``: a load never reads the
pickled ``.metadata``) and, saved with a key, a keyed digest
(:mod:`~areal_fn.plans.checkpoint.keyed`); its JSON carries its own digest.
:func:`make_manifest` builds it from a :class:`~areal_fn.plans.checkpoint.write.WritePlan`; :func:`check_model` and
:func:`check_optimizer` refuse a checkpoint saved for another model or optimizer.
Optimizers are named by :class:`OptimizerSpec` (:data:`OPTIMIZERS`). Pure: no files,
no ranks, no clock.
"""

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from areal_fn.errors import CheckpointError
from areal_fn.model.tensor_spec import DTYPE_BYTES, TensorSpec, dtype_name
from areal_fn.plans.checkpoint.storage import FileDigest as FileDigest
from areal_fn.plans.checkpoint.storage import StoredItem, check_storage
from areal_fn.plans.checkpoint.write import WritePlan
from areal_fn.plans.tensor_check import diff_shapes, joined
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype

FORMAT = "areal_fn.checkpoint"
FORMAT_VERSION = 1
#: key prefix of optimizer state tensors: ``optim/<canonical>/<state>``.
OPTIM_PREFIX = "optim/"

StateKind = Literal["moment", "scalar"]


def _tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


def optim_key(canonical: str, state: str) -> str:
    """Storage key of optimizer state ``state`` of canonical tensor ``canonical``."""
    return f"{OPTIM_PREFIX}{canonical}/{state}"


# -- optimizers ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class OptimizerState:
    """One per-parameter optimizer state: a ``moment`` has the parameter's shape and
    follows its pieces; a ``scalar`` (Adam's ``step``) is one value per tensor."""

    name: str
    kind: StateKind = attrs.field(validator=attrs.validators.in_(("moment", "scalar")))


@attrs.frozen(kw_only=True)
class OptimizerSpec:
    """An optimizer's name and per-parameter states (``none``: parameters only)."""

    name: str
    states: tuple[OptimizerState, ...] = attrs.field(converter=_tuple)

    @property
    def moments(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states if s.kind == "moment")

    @property
    def scalars(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states if s.kind == "scalar")

    def __str__(self) -> str:
        return f"{self.name}({', '.join(s.name for s in self.states)})"


def _adam(name: str) -> OptimizerSpec:
    return OptimizerSpec(
        name=name,
        states=(
            OptimizerState(name="exp_avg", kind="moment"),
            OptimizerState(name="exp_avg_sq", kind="moment"),
            OptimizerState(name="step", kind="scalar"),
        ),
    )


#: Optimizers known by name (torch's state names).
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "none": OptimizerSpec(name="none", states=()),
    "adam": _adam("adam"),
    "adamw": _adam("adamw"),
    "sgd": OptimizerSpec(
        name="sgd", states=(OptimizerState(name="momentum_buffer", kind="moment"),)
    ),
}


@beartype
def optimizer_spec(name: str) -> OptimizerSpec:
    """The :class:`OptimizerSpec` called ``name`` (one of :data:`OPTIMIZERS`)."""
    if name not in OPTIMIZERS:
        raise CheckpointError(
            f"optimizer={name!r} is not known; use one of {sorted(OPTIMIZERS)} or build an OptimizerSpec"
        )
    return OPTIMIZERS[name]


# -- manifest --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Chunk:
    """A stored box of a canonical tensor and the rank that wrote it."""

    box: Box
    rank: int


def _check_tiling(name: str, shape: tuple[int, ...], chunks: tuple[Chunk, ...]) -> None:
    full = Box.full(shape)
    total = 0
    for c in chunks:
        if c.box.ndim != len(shape) or not full.contains(c.box) or c.box.is_empty:
            raise CheckpointError(
                f"tensor {name!r}: chunk {c.box} does not lie inside its shape {shape}; the manifest is "
                "inconsistent"
            )
        total += c.box.numel
    if total != full.numel:
        raise CheckpointError(
            f"tensor {name!r}: its chunks hold {total} elements, its shape {shape} has {full.numel}; "
            "the chunks must tile the tensor exactly (the manifest is inconsistent)"
        )
    if len(shape) == 0:
        return
    active: list[Box] = []
    for c in sorted(chunks, key=lambda c: c.box.ranges):
        lo = c.box.ranges[0][0]
        active = [a for a in active if a.ranges[0][1] > lo]
        for a in active:
            if a.intersect(c.box) is not None:
                raise CheckpointError(
                    f"tensor {name!r}: chunks {a} and {c.box} overlap; every element must be stored once"
                )
        active.append(c.box)


@attrs.frozen(kw_only=True)
class SavedTensor:
    """A canonical tensor in a checkpoint: shape, dtypes and the chunks tiling it."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_tuple)
    dtype: str = attrs.field(converter=dtype_name)
    #: (state name, dtype) of its optimizer states, in optimizer order.
    state_dtypes: tuple[tuple[str, str], ...] = attrs.field(converter=_tuple, default=())
    chunks: tuple[Chunk, ...] = attrs.field(converter=_tuple)

    def __attrs_post_init__(self) -> None:
        _check_tiling(self.name, self.shape, self.chunks)

    @property
    def numel(self) -> int:
        return Box.full(self.shape).numel

    def element_bytes(self, scalars: Collection[str]) -> int:
        """Bytes stored per element: the parameter and its per-element states (the
        states named in ``scalars``, such as Adam's ``step``, hold one value each)."""
        return DTYPE_BYTES[self.dtype] + sum(
            DTYPE_BYTES[d] for n, d in self.state_dtypes if n not in scalars
        )

    def scalar_bytes(self, scalars: Collection[str]) -> int:
        """Bytes of its scalar states (one value each, written by :attr:`scalar_writer`)."""
        return sum(DTYPE_BYTES[d] for n, d in self.state_dtypes if n in scalars)

    def stored_bytes(self, scalars: Collection[str]) -> int:
        """Bytes stored for this tensor: every element's, then the scalar states once."""
        return self.numel * self.element_bytes(scalars) + self.scalar_bytes(scalars)

    @property
    def scalar_writer(self) -> int:
        """The rank that wrote the first chunk (by box): it also wrote the scalar states."""
        return min(self.chunks, key=lambda c: c.box.ranges).rank


def _check_hex(_inst: object, _attr: object, value: str | None) -> None:
    if value is not None and (len(value) != 64 or any(c not in "0123456789abcdef" for c in value)):
        raise CheckpointError(f"manifest_hmac {value!r} is not 64 lowercase hex digits")


def _json_text(value: object) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise CheckpointError(f"{value!r} is not JSON text") from None
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@attrs.frozen(kw_only=True)
class CheckpointManifest:
    """What a checkpoint directory holds (``manifest.json``).

    ``model_config`` and ``data_position`` are canonical JSON texts (sorted keys).
    ``extras`` lists the non-tensor entries (``train/lr_scheduler``, ``rng/<rank>``).
    ``storage`` locates every entry in the data files (empty in checkpoints saved before
    it was recorded: those are read only by unpickling ``.metadata``, on request);
    ``keyed_digest`` is the HMAC-SHA256 of the rest under the key of the job that
    saved it (``manifest_hmac``; None: saved without a key).
    """

    library_version: str
    allocation: str
    layout_kind: str
    world_size: int
    step: int
    model_config: str = attrs.field(converter=_json_text)
    data_position: str = attrs.field(converter=_json_text, default="null")
    optimizer: OptimizerSpec
    tensors: tuple[SavedTensor, ...] = attrs.field(converter=_tuple)
    extras: tuple[str, ...] = attrs.field(converter=_tuple, default=())
    files: tuple[FileDigest, ...] = attrs.field(converter=_tuple, default=())
    storage: tuple[StoredItem, ...] = attrs.field(converter=_tuple, default=())
    keyed_digest: str | None = attrs.field(default=None, validator=_check_hex)

    def __attrs_post_init__(self) -> None:
        if not isinstance(json.loads(self.model_config), dict):
            raise CheckpointError(
                f"model_config={self.model_config[:60]!r} must be a JSON object (an HF config.json)"
            )
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise CheckpointError("manifest lists a tensor twice")
        for t in self.tensors:
            got = tuple(s for s, _ in t.state_dtypes)
            want = tuple(s.name for s in self.optimizer.states)
            if got != want:
                raise CheckpointError(
                    f"tensor {t.name!r} has optimizer states {got}, the manifest's optimizer "
                    f"{self.optimizer} has {want}"
                )
        if self.storage:
            sizes = {f.path: f.size for f in self.files}
            check_storage(self.storage, expected=self.entries(), sizes=sizes)

    def entries(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every DCP entry as (key, its chunk's offsets): parameters and moments per chunk,
        scalar states and extras once with offsets ``()``."""
        out: list[tuple[str, tuple[int, ...]]] = []
        for t in self.tensors:
            starts = [c.box.start for c in t.chunks]
            out += [(t.name, s) for s in starts]
            for st in self.optimizer.states:
                key = optim_key(t.name, st.name)
                out += [(key, s) for s in starts] if st.kind == "moment" else [(key, ())]
        return (*out, *((x, ()) for x in self.extras))

    @property
    def model(self) -> dict[str, object]:
        """The model's HF ``config.json`` as a dict."""
        out: dict[str, object] = json.loads(self.model_config)
        return out

    def tensor(self, name: str) -> SavedTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise CheckpointError(f"the checkpoint holds no tensor {name!r}")

    def keys(self) -> tuple[str, ...]:
        """Every storage key: parameters, optimizer states, extras."""
        out = [t.name for t in self.tensors]
        out += [optim_key(t.name, s.name) for t in self.tensors for s in self.optimizer.states]
        return (*out, *self.extras)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def bytes_per_rank(self) -> dict[int, int]:
        """Tensor bytes each rank wrote: its chunks of every parameter and per-element
        state, and the scalar states (Adam's ``step``) of the tensors it wrote first."""
        scalars = self.optimizer.scalars
        out: dict[int, int] = {}
        for t in self.tensors:
            for c in t.chunks:
                out[c.rank] = out.get(c.rank, 0) + c.box.numel * t.element_bytes(scalars)
            out[t.scalar_writer] = out.get(t.scalar_writer, 0) + t.scalar_bytes(scalars)
        return dict(sorted(out.items()))

    # -- JSON ---------------------------------------------------------------------------
    def content_text(self) -> str:
        """Canonical JSON of every field but the digests: what ``manifest_hmac`` covers."""
        return _canonical(self._body())

    def _body(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "library_version": self.library_version,
            "allocation": self.allocation,
            "layout_kind": self.layout_kind,
            "world_size": self.world_size,
            "step": self.step,
            "data_position": json.loads(self.data_position),
            "model_config": json.loads(self.model_config),
            "optimizer": {
                "name": self.optimizer.name,
                "states": [[s.name, s.kind] for s in self.optimizer.states],
            },
            "tensors": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "state_dtypes": [list(p) for p in t.state_dtypes],
                    "chunks": [[[list(r) for r in c.box.ranges], c.rank] for c in t.chunks],
                }
                for t in self.tensors
            ],
            "extras": list(self.extras),
            "files": [f.to_json() for f in self.files],
        } | ({"storage": [s.to_json() for s in self.storage]} if self.storage else {})

    def to_json(self) -> str:
        """JSON text, with ``manifest_sha256`` over the rest (sorted keys, compact)."""
        body = self._body()
        if self.keyed_digest is not None:
            body["manifest_hmac"] = self.keyed_digest
        body["manifest_sha256"] = hashlib.sha256(_canonical(body).encode()).hexdigest()
        lines = []
        for key in sorted(body):  # one line per field, per tensor, per file: readable diffs
            value = body[key]
            if isinstance(value, list) and value and isinstance(value[0], dict):
                items = ",\n".join(f"  {_canonical(v)}" for v in value)
                lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
            else:
                lines.append(f" {json.dumps(key)}: {json.dumps(value, sort_keys=True)}")
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest.json") -> "CheckpointManifest":
        """Parse and check a manifest; ``CheckpointError`` naming ``source`` on any defect."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise CheckpointError(
                f"{source} is not valid JSON ({e}); the file is corrupted or truncated"
            ) from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(
                f"{source} is not an areal_fn checkpoint manifest (format must be {FORMAT!r})"
            )
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format_version={raw.get('format_version')!r}; this library reads "
                f"version {FORMAT_VERSION}"
            )
        digest = raw.pop("manifest_sha256", None)
        if digest != hashlib.sha256(_canonical(raw).encode()).hexdigest():
            raise CheckpointError(
                f"{source}: manifest_sha256 does not match its content; the manifest was modified or corrupted"
            )
        try:
            return _from_raw(raw)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{source}: malformed manifest ({type(e).__name__}: {e})"
            ) from None

    def __str__(self) -> str:
        return (
            f"checkpoint step {self.step}: {len(self.tensors)} tensors saved under {self.allocation} "
            f"({self.layout_kind}, {self.world_size} ranks), optimizer {self.optimizer}, "
            f"{len(self.files)} files {self.nbytes} B"
        )


def _canonical(body: object) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _from_raw(raw: dict[str, Any]) -> CheckpointManifest:
    """The manifest of a parsed ``manifest.json`` whose ``manifest_sha256`` was checked."""
    opt = raw["optimizer"]
    return CheckpointManifest(
        library_version=str(raw["library_version"]),
        allocation=str(raw["allocation"]),
        layout_kind=str(raw["layout_kind"]),
        world_size=int(raw["world_size"]),
        step=int(raw["step"]),
        model_config=json.dumps(raw["model_config"]),
        data_position=json.dumps(raw["data_position"]),
        optimizer=OptimizerSpec(
            name=str(opt["name"]),
            states=tuple(OptimizerState(name=n, kind=k) for n, k in opt["states"]),
        ),
        tensors=tuple(
            SavedTensor(
                name=t["name"],
                shape=tuple(t["shape"]),
                dtype=t["dtype"],
                state_dtypes=tuple((s, d) for s, d in t["state_dtypes"]),
                chunks=tuple(
                    Chunk(box=Box(ranges=tuple(tuple(r) for r in b)), rank=int(rk))
                    for b, rk in t["chunks"]
                ),
            )
            for t in raw["tensors"]
        ),
        extras=tuple(raw["extras"]),
        files=tuple(FileDigest.from_json(f) for f in raw["files"]),
        storage=tuple(StoredItem.from_json(x) for x in raw.get("storage", ())),
        keyed_digest=raw.get("manifest_hmac"),
    )


@beartype
def make_manifest(
    plan: WritePlan,
    *,
    allocation: str,
    model_config: Mapping[str, object],
    step: int,
    optimizer: OptimizerSpec,
    dtypes: Mapping[str, str],
    state_dtypes: Mapping[str, Mapping[str, str]] | None = None,
    data_position: object = None,
    extras: Sequence[str] = (),
    library_version: str,
    files: Sequence[FileDigest] = (),
) -> CheckpointManifest:
    """The manifest of a checkpoint written by ``plan``.

    ``dtypes[canonical]`` is the stored parameter dtype; ``state_dtypes[canonical][state]``
    each optimizer state's (default: the parameter's).
    """
    chunks = plan.chunks()
    tensors = []
    for spec in plan.canonical:
        dt = dtypes.get(spec.name, spec.dtype)
        sd = (state_dtypes or {}).get(spec.name, {})
        tensors.append(
            SavedTensor(
                name=spec.name,
                shape=spec.shape,
                dtype=dt,
                state_dtypes=tuple((s.name, sd.get(s.name, dt)) for s in optimizer.states),
                chunks=tuple(Chunk(box=b, rank=r) for b, r in chunks[spec.name]),
            )
        )
    return CheckpointManifest(
        library_version=library_version,
        allocation=allocation,
        layout_kind=plan.kind,
        world_size=plan.world_size,
        step=step,
        model_config=json.dumps(dict(model_config), sort_keys=True),
        data_position=json.dumps(data_position, sort_keys=True),
        optimizer=optimizer,
        tensors=tuple(tensors),
        extras=tuple(extras),
        files=tuple(files),
    )


# -- compatibility checks --------------------------------------------------------------


@beartype
def check_model(
    manifest: CheckpointManifest, canonical: Sequence[TensorSpec], *, source: str = "checkpoint"
) -> None:
    """``CheckpointError`` unless the checkpoint holds exactly these canonical tensors and shapes."""
    d = diff_shapes(
        {c.name: c.shape for c in canonical}, {t.name: t.shape for t in manifest.tensors}
    )
    if d.ok:
        return
    shapes = [f"{n}: saved {s}, expected {w}" for n, s, w in d.misshaped]
    missing, extra = d.missing, d.unexpected
    cfg = manifest.model
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} tensors differ in shape ({joined(shapes, '; ')})")
    if missing:
        problems.append(f"{len(missing)} tensors are missing ({joined(missing)})")
    if extra:
        problems.append(f"{len(extra)} tensors are not in the model ({joined(extra)})")
    raise CheckpointError(
        f"{source} was saved for another model ({cfg.get('model_type')}, hidden_size="
        f"{cfg.get('hidden_size')}, num_hidden_layers={cfg.get('num_hidden_layers')}, vocab_size="
        f"{cfg.get('vocab_size')}): "
        + "; ".join(problems)
        + ". Load it with the model it was saved "
        "for; nothing is dropped, added or reshaped silently"
    )


@beartype
def check_optimizer(
    manifest: CheckpointManifest, optimizer: OptimizerSpec, *, source: str = "checkpoint"
) -> None:
    """``CheckpointError`` unless the checkpoint's optimizer state matches ``optimizer``."""
    if optimizer.name == "none":
        return  # parameters only, asked for explicitly
    if manifest.optimizer != optimizer:
        raise CheckpointError(
            f"{source} holds optimizer state of {manifest.optimizer}, the target optimizer is "
            f"{optimizer}; load with the same optimizer, or with optimizer 'none' to load parameters only"
        )
