"""Allocation records: which backend runs on which ranks, with which parallel degrees.

An allocation string such as ``sglang:d4t2+megatron:d2p2t2`` is parsed by
:func:`areal_fn.strategy.parse.parse_allocation` into an :class:`Allocation`;
``str()`` of any record here prints the canonical string that parses back to an
equal value. ``repr()`` is Python that evaluates back (after
``from areal_fn.strategy.allocation import *``). Grammar and semantics: ``docs/allocation.md``.

Canonical printing: dims in the order ``d p t c e v``; ``d`` always printed (as
``d<replicas>x<shards>`` when ``dp_replicate`` is not 1, the HSDP spelling), every
other dim printed only when it is not 1. A Megatron component whose expert tensor
parallel size ``etp`` is not 1 prints in the hybrid form
``megatron:(attn:d..p..t..c..v..|ffn:d..p..t..e..)`` (``ffn`` ``d`` is the expert
data parallel size and is always printed); every other component prints in the
plain form, where ``etp`` is 1.
"""

import enum
import re

import attrs

from areal_fn.errors import SpecError
from areal_fn.typecheck import beartype

__all__ = [
    "MAX_DEGREE",
    "MAX_WORLD_SIZE",
    "Allocation",
    "Backend",
    "Component",
    "ParallelDims",
]

#: Largest degree accepted for any single dimension (2**20).
MAX_DEGREE = 2**20
#: Largest number of ranks of one component and of a whole allocation (2**20).
MAX_WORLD_SIZE = 2**20

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: ParallelDims fields in declaration (and repr) order.
_FIELDS = ("dp", "tp", "pp", "cp", "ep", "etp", "vpp", "dp_replicate")


class Backend(enum.Enum):
    """The engine that runs a component."""

    SGLANG = "sglang"
    VLLM = "vllm"
    FSDP = "fsdp"
    MEGATRON = "megatron"

    @property
    def is_inference(self) -> bool:
        """SGLang and vLLM serve rollouts."""
        return self in (Backend.SGLANG, Backend.VLLM)

    @property
    def is_training(self) -> bool:
        """FSDP and Megatron train."""
        return self in (Backend.FSDP, Backend.MEGATRON)

    def __repr__(self) -> str:
        return f"Backend.{self.name}"

    def __str__(self) -> str:
        return self.value


_HSDP_ONLY = (
    "HSDP replicas x shards ('d2x4') are an fsdp spelling; write d as one number, e.g. 'd8'"
)

#: ParallelDims fields each backend leaves at 1, with the reason and the remedy.
_FIXED_BY_BACKEND: dict[Backend, tuple[tuple[str, str], ...]] = {
    Backend.SGLANG: (
        ("cp", "inference backends take d, t, p only"),
        (
            "ep",
            "inference backends take d, t, p only; set expert parallelism in the engine's own options",
        ),
        ("etp", "inference backends take d, t, p only"),
        ("vpp", "inference backends take d, t, p only"),
        ("dp_replicate", _HSDP_ONLY),
    ),
    Backend.FSDP: (
        ("pp", "use megatron for pipeline parallelism"),
        ("ep", "use megatron for expert parallelism"),
        ("etp", "use megatron for expert tensor parallelism"),
        ("vpp", "use megatron with pp >= 2 for virtual pipeline stages"),
    ),
    Backend.MEGATRON: (("dp_replicate", _HSDP_ONLY),),
}
_FIXED_BY_BACKEND[Backend.VLLM] = _FIXED_BY_BACKEND[Backend.SGLANG]


def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n >= 1``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return tuple(small + large)


@beartype
def choices(n: int) -> str:
    """The divisors of ``n`` as ``{1, 2, 4}``, or a phrase when there are many."""
    ds = divisors(n)
    if len(ds) > 16:
        return f"the divisors of {n}"
    return "{" + ", ".join(str(d) for d in ds) + "}"


@beartype
def expert_rule(*, dp: int, tp: int, cp: int, ep: int, etp: int) -> str | None:
    """Why ``ep*etp`` cannot tile one pipeline stage ``dp*tp*cp``, or None if it can."""
    stage = dp * tp * cp
    if stage % (ep * etp) == 0:
        return None
    return (
        f"ep*etp = {ep}*{etp} = {ep * etp} does not divide dp*tp*cp = {dp}*{tp}*{cp} = {stage}, "
        f"the ranks of one pipeline stage that the expert layers are laid over "
        f"(ep*etp*edp must equal dp*tp*cp); choose ep*etp in {choices(stage)}"
    )


def _degree(inst: object, attribute: "attrs.Attribute[int]", value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(
            f"ParallelDims.{attribute.name}={value!r} is not an int; pass a degree such as 2"
        )
    if not 1 <= value <= MAX_DEGREE:
        raise SpecError(
            f"ParallelDims.{attribute.name}={value} is out of range; every degree must be "
            f"an int in [1, {MAX_DEGREE}] (2**20)"
        )


def _section(pairs: tuple[tuple[str, int], ...], replicas: int = 1) -> str:
    out = []
    for letter, value in pairs:
        if letter == "d":
            out.append(f"d{replicas}x{value // replicas}" if replicas > 1 else f"d{value}")
        elif value != 1:
            out.append(f"{letter}{value}")
    return "".join(out)


@attrs.frozen(kw_only=True, repr=False)
class ParallelDims:
    """Parallel degrees of one component; every degree is an int >= 1 (default 1).

    ``dp``/``tp``/``pp``/``cp``: data, tensor, pipeline and context parallel sizes of
    the dense (attention) layers; their product is the world size. ``ep``/``etp``:
    expert parallel and expert tensor parallel sizes of the MoE layers, laid over the
    ``dp*tp*cp`` ranks of each pipeline stage (Megatron "MoE parallel folding"), so
    ``ep*etp`` must divide ``dp*tp*cp``; the rest is the expert data parallel size
    :attr:`edp`. ``vpp``: virtual pipeline stages per rank (needs ``pp >= 2``).
    ``dp_replicate``: HSDP replicas (torchtitan's ``dp_replicate``, fsdp only), which
    divides ``dp``; the ``dp`` ranks are ``dp_replicate`` replicas of :attr:`dp_shard`
    FSDP shards each.
    """

    dp: int = attrs.field(default=1, validator=_degree)
    tp: int = attrs.field(default=1, validator=_degree)
    pp: int = attrs.field(default=1, validator=_degree)
    cp: int = attrs.field(default=1, validator=_degree)
    ep: int = attrs.field(default=1, validator=_degree)
    etp: int = attrs.field(default=1, validator=_degree)
    vpp: int = attrs.field(default=1, validator=_degree)
    dp_replicate: int = attrs.field(default=1, validator=_degree)

    def __attrs_post_init__(self) -> None:
        world = self.dp * self.tp * self.pp * self.cp
        if world > MAX_WORLD_SIZE:
            raise SpecError(
                f"ParallelDims world size dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} "
                f"= {world} exceeds the maximum {MAX_WORLD_SIZE} (2**20); use smaller degrees"
            )
        if self.vpp > 1 and self.pp == 1:
            raise SpecError(
                f"ParallelDims.vpp={self.vpp} needs pp >= 2 (virtual stages interleave a real "
                f"pipeline), got pp=1; set pp >= 2 or vpp=1"
            )
        problem = expert_rule(dp=self.dp, tp=self.tp, cp=self.cp, ep=self.ep, etp=self.etp)
        if problem is not None:
            raise SpecError(f"ParallelDims: {problem}")
        if self.dp % self.dp_replicate:
            raise SpecError(
                f"ParallelDims.dp_replicate={self.dp_replicate} does not divide dp={self.dp}; "
                f"HSDP splits the dp ranks into dp_replicate replicas x dp/dp_replicate shards; "
                f"use dp_replicate in {choices(self.dp)}"
            )

    @property
    def world_size(self) -> int:
        """Number of ranks: ``dp*tp*pp*cp``."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Expert data parallel size: ``world_size // (pp*ep*etp)``."""
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def dp_shard(self) -> int:
        """FSDP shards per HSDP replica: ``dp // dp_replicate`` (``cp`` not included)."""
        return self.dp // self.dp_replicate

    @property
    def is_hybrid(self) -> bool:
        """True when ``etp != 1``: only the hybrid ``(attn:...|ffn:...)`` form can say so."""
        return self.etp != 1

    def __str__(self) -> str:
        if not self.is_hybrid:
            return _section(
                (
                    ("d", self.dp),
                    ("p", self.pp),
                    ("t", self.tp),
                    ("c", self.cp),
                    ("e", self.ep),
                    ("v", self.vpp),
                ),
                self.dp_replicate,
            )
        attn = _section(
            (("d", self.dp), ("p", self.pp), ("t", self.tp), ("c", self.cp), ("v", self.vpp)),
            self.dp_replicate,
        )
        ffn = _section((("d", self.edp), ("p", self.pp), ("t", self.etp), ("e", self.ep)))
        return f"(attn:{attn}|ffn:{ffn})"

    def __repr__(self) -> str:
        shown = [f"{f}={getattr(self, f)}" for f in _FIELDS if f == "dp" or getattr(self, f) != 1]
        return f"ParallelDims({', '.join(shown)})"


def _to_backend(value: object) -> Backend:
    if isinstance(value, Backend):
        return value
    for backend in Backend:
        if value == backend.value:
            return backend
    raise SpecError(
        f"Component.backend={value!r} is not a backend; use one of "
        f"{', '.join(repr(b) for b in Backend)} or their names "
        f"{', '.join(repr(b.value) for b in Backend)}"
    )


def _check_name(inst: object, attribute: "attrs.Attribute[str | None]", value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None:
        raise SpecError(
            f"Component.name={value!r} is not an ASCII identifier; a name is a letter or '_' "
            f"followed by letters, digits or '_' (e.g. 'actor'), or None"
        )


def _check_dims(inst: object, attribute: "attrs.Attribute[ParallelDims]", value: object) -> None:
    if not isinstance(value, ParallelDims):
        raise SpecError(
            f"Component.dims={value!r} is not a ParallelDims; pass e.g. ParallelDims(dp=4, tp=2)"
        )


@attrs.frozen(kw_only=True)
class Component:
    """One engine: optional name, backend and parallel degrees.

    Inference backends (sglang, vllm) take ``dp``, ``tp``, ``pp``; fsdp takes ``dp``,
    ``tp``, ``cp`` and ``dp_replicate`` (HSDP); megatron takes every degree but
    ``dp_replicate``. Degrees a backend does not take must be 1.
    """

    name: str | None = attrs.field(default=None, validator=_check_name)
    backend: Backend = attrs.field(converter=_to_backend)
    dims: ParallelDims = attrs.field(validator=_check_dims)

    def __attrs_post_init__(self) -> None:
        for field, remedy in _FIXED_BY_BACKEND[self.backend]:
            value = getattr(self.dims, field)
            if value != 1:
                raise SpecError(
                    f"Component {self.label}: backend {self.backend.value} does not support "
                    f"{field}={value} (only {field}=1); {remedy}"
                )

    @property
    def label(self) -> str:
        """``backend[name]`` or ``backend``, for messages."""
        if self.name is None:
            return self.backend.value
        return f"{self.backend.value}[{self.name}]"

    @property
    def world_size(self) -> int:
        """Number of ranks this component runs on."""
        return self.dims.world_size

    @property
    def is_inference(self) -> bool:
        return self.backend.is_inference

    @property
    def is_training(self) -> bool:
        return self.backend.is_training

    @property
    def is_hybrid(self) -> bool:
        """True when it prints in the megatron hybrid ``(attn:...|ffn:...)`` form."""
        return self.dims.is_hybrid

    def __str__(self) -> str:
        return f"{self.label}:{self.dims}"


def _to_groups(value: object) -> tuple[tuple[object, ...], ...]:
    if not isinstance(value, (tuple, list)):
        raise SpecError(
            f"Allocation.groups={value!r} is not a tuple of groups; pass a tuple of tuples "
            f"of Component, e.g. ((Component(...),), (Component(...), Component(...)))"
        )
    groups = []
    for i, group in enumerate(value):
        if not isinstance(group, (tuple, list)):
            raise SpecError(
                f"Allocation.groups[{i}]={group!r} is not a tuple of Component; wrap a single "
                f"component as (component,)"
            )
        groups.append(tuple(group))
    return tuple(groups)


def _check_groups(
    inst: object,
    attribute: "attrs.Attribute[tuple[tuple[Component, ...], ...]]",
    value: tuple[tuple[object, ...], ...],
) -> None:
    if not value:
        raise SpecError("Allocation.groups is empty; an allocation has at least one component")
    for i, group in enumerate(value):
        if not group:
            raise SpecError(f"Allocation.groups[{i}] is empty; every group has a component")
        for j, comp in enumerate(group):
            if not isinstance(comp, Component):
                raise SpecError(
                    f"Allocation.groups[{i}][{j}]={comp!r} is not a Component; pass "
                    f"Component(backend=..., dims=...)"
                )


@attrs.frozen(kw_only=True)
class Allocation:
    """Components on consecutive rank ranges.

    ``groups`` is a tuple of colocation groups. The groups are disaggregated: they
    get disjoint consecutive rank ranges in order (``+`` in the string). The
    components of one group are colocated: they have equal world sizes and share
    one rank range (``|`` in the string). Names are unique; with three or more
    components every component has one.
    """

    groups: tuple[tuple[Component, ...], ...] = attrs.field(
        converter=_to_groups, validator=_check_groups
    )

    def __attrs_post_init__(self) -> None:
        for group in self.groups:
            first = group[0]
            for comp in group[1:]:
                if comp.world_size != first.world_size:
                    raise SpecError(
                        f"Allocation: colocated components share one rank range and need equal "
                        f"world sizes, but {first} has {first.world_size} and {comp} has "
                        f"{comp.world_size}; make the degrees multiply to the same number "
                        f"or disaggregate them with '+'"
                    )
        seen: set[str] = set()
        for comp in self.components:
            if comp.name is not None:
                if comp.name in seen:
                    raise SpecError(
                        f"Allocation: name {comp.name!r} is used twice; every name must be unique"
                    )
                seen.add(comp.name)
        unnamed = [str(c) for c in self.components if c.name is None]
        if len(self.components) >= 3 and unnamed:
            raise SpecError(
                f"Allocation: with {len(self.components)} components every component needs a "
                f"name, but {', '.join(unnamed)} has none; name it, e.g. "
                f"Component(name='actor', ...) or 'fsdp[actor]:d4'"
            )
        if self.world_size > MAX_WORLD_SIZE:
            raise SpecError(
                f"Allocation: world size {self.world_size} exceeds the maximum "
                f"{MAX_WORLD_SIZE} (2**20); use smaller degrees or fewer components"
            )

    @property
    def components(self) -> tuple[Component, ...]:
        """All components, group by group, in string order."""
        return tuple(comp for group in self.groups for comp in group)

    @property
    def world_size(self) -> int:
        """Total ranks: the sum over groups of each group's (shared) world size."""
        return sum(group[0].world_size for group in self.groups)

    @property
    def group_ranges(self) -> tuple[range, ...]:
        """The rank range of each group: disjoint, consecutive, starting at 0."""
        out = []
        start = 0
        for group in self.groups:
            out.append(range(start, start + group[0].world_size))
            start += group[0].world_size
        return tuple(out)

    @property
    def rank_ranges(self) -> tuple[range, ...]:
        """The rank range of each component, aligned with :attr:`components`."""
        return tuple(
            rng for group, rng in zip(self.groups, self.group_ranges, strict=True) for _ in group
        )

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the named components, in order."""
        return tuple(c.name for c in self.components if c.name is not None)

    @beartype
    def component(self, name: str) -> Component:
        """The component called ``name``."""
        for comp in self.components:
            if comp.name == name:
                return comp
        raise SpecError(f"no component is named {name!r} in {self}; names are {list(self.names)}")

    @beartype
    def rank_range(self, key: "str | Component") -> range:
        """Rank range of the component named ``key``, or of the component ``key``."""
        comp = self.component(key) if isinstance(key, str) else key
        found = [rng for c, rng in zip(self.components, self.rank_ranges, strict=True) if c == comp]
        if not found:
            raise SpecError(f"component {comp} is not part of {self}")
        if len(found) > 1:
            raise SpecError(
                f"component {comp} appears {len(found)} times in {self}; name the components "
                f"and look them up by name, or use rank_ranges"
            )
        return found[0]

    @beartype
    def by_backend(self, backend: Backend) -> tuple[Component, ...]:
        """The components run by ``backend``, in order."""
        return tuple(c for c in self.components if c.backend is backend)

    @property
    def training_components(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.is_training)

    @property
    def inference_components(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.is_inference)

    @property
    def training(self) -> Component:
        """The one training component; an error if there are none or several."""
        return _only(self.training_components, "training", self)

    @property
    def inference(self) -> Component:
        """The one inference component; an error if there are none or several."""
        return _only(self.inference_components, "inference", self)

    def __str__(self) -> str:
        return "+".join("|".join(str(c) for c in group) for group in self.groups)


def _only(found: tuple[Component, ...], kind: str, allocation: Allocation) -> Component:
    if len(found) == 1:
        return found[0]
    if not found:
        raise SpecError(f"{allocation} has no {kind} component")
    raise SpecError(
        f"{allocation} has {len(found)} {kind} components ({', '.join(str(c) for c in found)}); "
        f"look one up by name with component(name), or use {kind}_components"
    )
