"""Per-rank memory of a layout: exact model state, estimated activations.

:func:`estimate_memory` returns a :class:`MemoryReport` with one row per rank.

**Exact part** (what the runtime allocates for the layout, from shape arithmetic on
the layout's logical tensors, padding rows included):

- ``params`` = sum over the rank's local tensors of ``numel * bytes(param_dtype)``
  (:func:`local_param_bytes` is the same sum, written plainly, for oracles);
- ``grads`` = the same numels times ``bytes(grad_dtype)``;
- ``optimizer`` = per optimizer element ``bytes(master_dtype)`` when the policy keeps
  master weights, plus ``states * bytes(state_dtype)`` (Adam: 2 moments, SGD with
  momentum: 1, plain SGD: 0), plus one 0-d fp32 ``step`` tensor (4 bytes) per local
  tensor for Adam, as ``torch.optim.Adam``/``AdamW`` keep it, plus 8 bytes of loss-scale
  state when the policy has a ``loss_scale``.

  Which elements carry optimizer state depends on the layout's ``kind``:
  ``fsdp2`` (and any other training layout): every local element (the optimizer
  steps the local shards). ``megatron`` with ``distributed_optimizer=True``
  (Megatron's ``use_distributed_optimizer``, AReaL's default): each rank owns
  ``ceil(n / g)`` of the ``n`` local elements replicated over a data-parallel group
  of ``g`` ranks (mesh axes ``dp``, ``cp``, ``edp`` on which the tensor is
  replicated), summed per group size; Megatron's bucket alignment padding (under
  0.1%) is left out. ``inference``: weights only, no gradients, no optimizer.

  With ``optimizer_offload`` (Megatron's ``optimizer_cpu_offload``, FSDP2's optimizer
  on CPU) the master copy and the optimizer states live in host memory: ``optimizer``
  is 0 on the device.

**Estimated part** (needs ``activation``, ``model`` and ``dims``; an estimate, not a
measurement): ``activations``, the bytes a rank keeps for the backward pass, and
``buffers``, FSDP2's unsharded parameters and gradient in flight; the formulas are in
:mod:`areal_fn.plans.memory.activations`.

Everything is integer arithmetic, so reports are deterministic and exact where stated.
"""

import enum
import math
from collections.abc import Iterable, Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES, dtype_name
from areal_fn.plans.advisor.census import Census, CensusIndex, RankShare, census_of
from areal_fn.plans.memory.activations import ActivationModel as ActivationModel
from areal_fn.plans.memory.activations import _activations, _buffers, _check_bool, _positive_int
from areal_fn.plans.memory.activations import in_flight_chunks as in_flight_chunks
from areal_fn.plans.memory.activations import layer_token_bytes as layer_token_bytes
from areal_fn.plans.optim import LossScale
from areal_fn.sharding.sharding import local_shape
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.coerce import Strategy, as_dims
from areal_fn.typecheck import beartype

__all__ = [
    "ActivationModel",
    "MemoryReport",
    "Optimizer",
    "PrecisionPolicy",
    "RankMemory",
    "data_parallel_numels",
    "estimate_memory",
    "estimate_rows",
    "local_param_bytes",
]

GIB = 1024**3
#: Bytes of the 0-d fp32 ``step`` tensor torch's Adam/AdamW keep per parameter.
STEP_BYTES = 4
_FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


class Optimizer(enum.Enum):
    """An optimizer, by the state it keeps per parameter element."""

    ADAM = "adam"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"

    @property
    def states(self) -> int:
        """State tensors per parameter element (Adam: exp_avg and exp_avg_sq)."""
        return {Optimizer.ADAM: 2, Optimizer.SGD: 0, Optimizer.SGD_MOMENTUM: 1}[self]

    @property
    def step_bytes(self) -> int:
        """Bytes of per-tensor scalars: Adam's 0-d fp32 ``step``."""
        return STEP_BYTES if self is Optimizer.ADAM else 0

    def __repr__(self) -> str:
        return f"Optimizer.{self.name}"


def _optimizer(value: object) -> Optimizer:
    if isinstance(value, Optimizer):
        return value
    names = {o.value: o for o in Optimizer} | {"adamw": Optimizer.ADAM}
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise SpecError(
        f"PrecisionPolicy.optimizer={value!r} is not a known optimizer; use one of "
        f"{sorted(names)} (adamw keeps the same state as adam)"
    )


def _float_dtype(value: object) -> str:
    name = dtype_name(value)  # type: ignore[arg-type]
    if name not in _FLOAT_DTYPES:
        raise SpecError(
            f"dtype {value!r} is not a floating dtype; parameters, gradients and optimizer "
            f"state use one of {list(_FLOAT_DTYPES)}"
        )
    return name


@attrs.frozen(kw_only=True)
class PrecisionPolicy:
    """Dtypes of parameters, gradients, master weights and optimizer state.

    ``param_dtype``: the parameters a rank holds (Megatron's model weights, FSDP2's
    sharded parameters). ``grad_dtype``: gradients (Megatron's ``main_grad`` buffer;
    in torch a ``.grad`` has the parameter's dtype). ``master_weights``: the optimizer
    keeps a copy in ``master_dtype`` (Megatron's fp32 main params). ``compute_dtype``:
    activations and FSDP2's all-gathered parameters. ``loss_scale``: fp16's dynamic
    loss scale (the engines scale the loss, unscale the gradients and skip steps with
    inf/NaN gradients; its state is :attr:`loss_scale_bytes` per rank). Bytes per
    parameter element of model state: :attr:`bytes_per_param`.
    """

    param_dtype: str = attrs.field(default="bfloat16", converter=_float_dtype)
    grad_dtype: str = attrs.field(default="float32", converter=_float_dtype)
    master_weights: bool = attrs.field(default=True, validator=_check_bool)
    master_dtype: str = attrs.field(default="float32", converter=_float_dtype)
    optimizer: Optimizer = attrs.field(default=Optimizer.ADAM, converter=_optimizer)
    state_dtype: str = attrs.field(default="float32", converter=_float_dtype)
    compute_dtype: str = attrs.field(default="bfloat16", converter=_float_dtype)
    loss_scale: LossScale | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(LossScale))
    )

    @classmethod
    def bf16_mixed(cls) -> "PrecisionPolicy":
        """bf16 weights, fp32 gradients, fp32 master weights, fp32 Adam: 18 B/param."""
        return cls()

    @classmethod
    def fp32(cls) -> "PrecisionPolicy":
        """Everything fp32 (fp32 compute too), Adam: 16 B/param."""
        return cls(
            param_dtype="float32",
            grad_dtype="float32",
            master_weights=False,
            state_dtype="float32",
            compute_dtype="float32",
        )

    @classmethod
    def fp32_params_bf16_compute(cls) -> "PrecisionPolicy":
        """FSDP2 mixed precision: fp32 sharded weights and Adam, bf16 compute: 16 B/param."""
        return cls(param_dtype="float32", grad_dtype="float32", master_weights=False)

    @classmethod
    def bf16_pure(cls) -> "PrecisionPolicy":
        """All bf16, no master weights (torch AdamW on bf16 parameters): 8 B/param."""
        return cls(
            param_dtype="bfloat16",
            grad_dtype="bfloat16",
            master_weights=False,
            state_dtype="bfloat16",
        )

    @classmethod
    def fp16_mixed(cls) -> "PrecisionPolicy":
        """Megatron's fp16: as :meth:`bf16_mixed` in fp16, dynamic loss scale: 18 B/param."""
        return cls(param_dtype="float16", compute_dtype="float16", loss_scale=LossScale())

    @classmethod
    def fp32_params_fp16_compute(cls) -> "PrecisionPolicy":
        """FSDP2's fp16: fp32 weights and Adam, fp16 autocast, dynamic loss scale: 16 B/param."""
        fp16 = LossScale()
        return cls(
            param_dtype="float32", master_weights=False, compute_dtype="float16", loss_scale=fp16
        )

    @property
    def loss_scale_bytes(self) -> int:
        """Per rank: the fp32 scale and the int32 count of steps since the last overflow."""
        return 8 if self.loss_scale is not None else 0

    @property
    def optimizer_bytes_per_element(self) -> int:
        """Master copy plus optimizer states per optimizer element."""
        master = DTYPE_BYTES[self.master_dtype] if self.master_weights else 0
        return master + self.optimizer.states * DTYPE_BYTES[self.state_dtype]

    @property
    def bytes_per_param(self) -> int:
        """Parameter + gradient + master + states bytes per element (unsharded state)."""
        return (
            DTYPE_BYTES[self.param_dtype]
            + DTYPE_BYTES[self.grad_dtype]
            + self.optimizer_bytes_per_element
        )

    def __str__(self) -> str:
        master = f"{self.master_dtype} master, " if self.master_weights else "no master, "
        return (
            f"params {self.param_dtype}, grads {self.grad_dtype}, {master}"
            f"{self.optimizer.value} states {self.state_dtype}, compute {self.compute_dtype} "
            f"({self.bytes_per_param} B/param)"
            + (", dynamic loss scale" if self.loss_scale is not None else "")
        )


def _nonneg(inst: object, attr: "attrs.Attribute[int]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{type(inst).__name__}.{attr.name}={value!r} must be an int >= 0")


@attrs.frozen(kw_only=True)
class RankMemory:
    """Bytes one rank holds. ``params``/``grads``/``optimizer`` are exact for the layout;
    ``activations``/``buffers`` are estimates (0 without an activation model)."""

    rank: int = attrs.field(validator=_nonneg)
    params: int = attrs.field(validator=_nonneg)
    grads: int = attrs.field(validator=_nonneg)
    optimizer: int = attrs.field(validator=_nonneg)
    activations: int = attrs.field(default=0, validator=_nonneg)
    buffers: int = attrs.field(default=0, validator=_nonneg)

    @property
    def model_state(self) -> int:
        """``params + grads + optimizer`` (the exact part)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def same_bytes(self, other: "RankMemory") -> bool:
        return attrs.evolve(other, rank=self.rank) == self


def _rows(value: Iterable[RankMemory]) -> tuple[RankMemory, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class MemoryReport:
    """Per-rank memory of one layout under one policy; ``str()`` is a table in GiB."""

    kind: str
    world_size: int = attrs.field(validator=_positive_int)
    policy: PrecisionPolicy
    activation: ActivationModel | None
    rows: tuple[RankMemory, ...] = attrs.field(converter=_rows)
    #: the optimizer's master copy and states are in host memory (``optim`` is 0)
    optimizer_offload: bool = attrs.field(default=False, validator=_check_bool)

    def __attrs_post_init__(self) -> None:
        ranks = [r.rank for r in self.rows]
        if ranks != list(range(self.world_size)):
            raise SpecError(
                f"MemoryReport needs one row per rank 0..{self.world_size - 1} in order, got "
                f"ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}"
            )

    @property
    def max_rank(self) -> RankMemory:
        """The row with the largest total (the lowest rank among ties)."""
        return max(self.rows, key=lambda r: (r.total, -r.rank))

    @property
    def max_total(self) -> int:
        return self.max_rank.total

    def __str__(self) -> str:
        return self.table()

    def table(self, *, first_rank: int = 0) -> str:
        """The table in GiB, ranks numbered from ``first_rank`` (a component's first
        global rank in an allocation; the rows hold the layout's own ranks)."""
        act = str(self.activation) if self.activation else "no activation model"
        if self.optimizer_offload:
            act += "; optimizer state offloaded to host memory"
        head = (
            f"MemoryReport {self.kind}, {self.world_size} ranks; {self.policy}; {act}\n"
            f"{'ranks':<12}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'buffers':>9}"
            f"{'total':>9}  GiB"
        )
        lines = [head]
        start = 0
        for i in range(1, len(self.rows) + 1):
            if i < len(self.rows) and self.rows[i].same_bytes(self.rows[start]):
                continue
            r = self.rows[start]
            lo, hi = first_rank + start, first_rank + i - 1
            label = str(lo) if hi == lo else f"{lo}-{hi}"
            cells = (r.params, r.grads, r.optimizer, r.activations, r.buffers, r.total)
            lines.append(f"{label:<12}" + "".join(f"{c / GIB:9.2f}" for c in cells))
            start = i
        m = self.max_rank
        lines.append(
            f"max: rank {first_rank + m.rank}, {m.total / GIB:.2f} GiB ({m.total:,} bytes); params, grads, "
            f"optim exact for the layout, activ and buffers estimated"
        )
        return "\n".join(lines)


# -- exact model state ----------------------------------------------------------------


@beartype
def local_param_bytes(layout: Layout, rank: int, dtype: str) -> int:
    """Bytes of ``rank``'s local tensors in ``dtype``: ``sum(numel) * bytes(dtype)``.

    Written plainly (one ``local_shape`` per present logical tensor) so that it can be
    compared with ``sum(p.numel() * p.element_size())`` of a real module's parameters.
    """
    size = DTYPE_BYTES[dtype_name(dtype)]
    if not 0 <= rank < layout.world_size:
        raise SpecError(
            f"rank={rank} is outside this {layout.kind} layout of {layout.world_size} ranks; "
            f"use 0..{layout.world_size - 1}"
        )
    return size * sum(
        math.prod(local_shape(t.shape, t.sharding, rank))
        for t in layout.tensors
        if t.is_present(rank)
    )


@beartype
def data_parallel_numels(layout: Layout | Census, rank: int) -> tuple[tuple[int, int], ...]:
    """``rank``'s local elements by the size of the data-parallel group they are replicated
    over: ``((group size, numel), ...)`` ascending; size 1 for elements no rank shares.

    These are the buffers a data-parallel gradient reduction moves, and what Megatron's
    distributed optimizer shards.
    """
    return CensusIndex(_census(layout)).share(rank).by_dp_group


def _state(
    census: Census,
    share: RankShare,
    policy: PrecisionPolicy,
    distributed_optimizer: bool,
    optimizer_offload: bool = False,
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes a rank holding ``share`` keeps on its device."""
    numel = share.numel
    params = numel * DTYPE_BYTES[policy.param_dtype]
    if census.kind == "inference":
        return params, 0, 0
    grads = numel * DTYPE_BYTES[policy.grad_dtype]
    if optimizer_offload:
        return params, grads, 0
    if census.kind == "megatron" and distributed_optimizer:
        opt_numel = sum(-(-n // d) for d, n in share.by_dp_group)
    else:
        opt_numel = numel
    optimizer = (
        opt_numel * policy.optimizer_bytes_per_element
        + share.tensors * policy.optimizer.step_bytes
        + policy.loss_scale_bytes
    )
    return params, grads, optimizer


# -- the report -----------------------------------------------------------------------


def _check_inputs(
    census: Census,
    activation: ActivationModel | None,
    model: ModelSpec | None,
    dims: ParallelDims | None,
) -> None:
    if activation is None:
        return
    if census.kind == "inference":
        raise SpecError(
            "estimate_memory: activations of an inference engine (KV cache, CUDA graphs) are "
            "not modelled; pass activation=None for the weights of an inference layout"
        )
    if model is None or dims is None:
        raise SpecError(
            "estimate_memory: an activation model needs model= (the ModelSpec) and dims= (the "
            "ParallelDims): a layout does not record hidden sizes, tp, cp or pp; pass both or "
            "activation=None"
        )
    if dims.world_size != census.world_size:
        raise SpecError(
            f"estimate_memory: dims={dims} has world size {dims.world_size} but the "
            f"{census.kind} layout has {census.world_size} ranks; pass the dims the layout "
            f"was built from"
        )
    for mesh in census.meshes:
        for axis, value in (("pp", dims.pp), ("tp", dims.tp), ("cp", dims.cp)):
            if axis in mesh.names and mesh.axis_size(axis) != value:
                raise SpecError(
                    f"estimate_memory: dims={dims} has {axis}={value} but the {census.kind} "
                    f"layout's {mesh} has {axis}={mesh.axis_size(axis)}; pass the dims the "
                    f"layout was built from"
                )


def _row(
    index: CensusIndex,
    rank: int,
    policy: PrecisionPolicy,
    activation: ActivationModel | None,
    model: ModelSpec | None,
    dims: ParallelDims | None,
    distributed_optimizer: bool,
    optimizer_offload: bool = False,
) -> RankMemory:
    share = index.share(rank)
    params, grads, optimizer = _state(
        index.census, share, policy, distributed_optimizer, optimizer_offload
    )
    acts = bufs = 0
    if activation is not None and model is not None and dims is not None:
        cb, gb = DTYPE_BYTES[policy.compute_dtype], DTYPE_BYTES[policy.grad_dtype]
        acts = _activations(model, dims, activation, cb, share.layers, index.stage(rank))
        bufs = _buffers(index.census, model, dims, cb, gb)
    return RankMemory(
        rank=rank,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=acts,
        buffers=bufs,
    )


_BF16_MIXED = PrecisionPolicy.bf16_mixed()


def _census(layout: Layout | Census) -> Census:
    return layout if isinstance(layout, Census) else census_of(layout)


@beartype
def estimate_memory(
    layout: Layout | Census,
    policy: PrecisionPolicy = _BF16_MIXED,
    *,
    activation: ActivationModel | None = None,
    model: ModelSpec | None = None,
    dims: Strategy | None = None,
    distributed_optimizer: bool = True,
    optimizer_offload: bool = False,
) -> MemoryReport:
    """Every rank's memory for ``layout`` (or its :class:`~areal_fn.plans.advisor.census.Census`).

    Parameters, gradients and optimizer state are exact (see the module docstring);
    with ``activation`` (which needs ``model`` and ``dims``) activations and FSDP2
    buffers are estimated. Ranks that differ only along axes where every tensor is
    replicated are computed once. ``dims`` may also be an allocation string or
    component of one component (``"megatron:d2p2t2"``). ``optimizer_offload``: the
    optimizer state is in host memory (see the module docstring).
    """
    dims = None if dims is None else as_dims(dims, caller="estimate_memory")
    census = _census(layout)
    _check_inputs(census, activation, model, dims)
    index = CensusIndex(census)
    by_key: dict[tuple[tuple[int, ...], ...], RankMemory] = {}
    rows = []
    for rank in range(census.world_size):
        k = index.key(rank)
        if k not in by_key:
            by_key[k] = _row(
                index,
                rank,
                policy,
                activation,
                model,
                dims,
                distributed_optimizer,
                optimizer_offload,
            )
        rows.append(attrs.evolve(by_key[k], rank=rank))
    return MemoryReport(
        kind=census.kind,
        world_size=census.world_size,
        policy=policy,
        activation=activation,
        rows=tuple(rows),
        optimizer_offload=optimizer_offload,
    )


@beartype
def estimate_rows(
    layout: Layout | Census,
    ranks: Sequence[int],
    policy: PrecisionPolicy = _BF16_MIXED,
    *,
    activation: ActivationModel | None = None,
    model: ModelSpec | None = None,
    dims: Strategy | None = None,
    distributed_optimizer: bool = True,
    optimizer_offload: bool = False,
) -> tuple[RankMemory, ...]:
    """The rows of :func:`estimate_memory` (same arguments) for ``ranks`` only."""
    dims = None if dims is None else as_dims(dims, caller="estimate_rows")
    census = _census(layout)
    _check_inputs(census, activation, model, dims)
    index = CensusIndex(census)
    return tuple(
        _row(index, r, policy, activation, model, dims, distributed_optimizer, optimizer_offload)
        for r in ranks
    )
