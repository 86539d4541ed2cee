"""LoRA adapters in a transformers model: the layers, their injection, their TP styles.

:func:`inject_lora` replaces every linear layer a :class:`~areal_fn.model.lora.LoraConfig`
targets with a :class:`LoraLinear`, which keeps the layer's own ``weight`` (and
``bias``) and adds two children, ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``),
so that the parameters carry the names :func:`~areal_fn.layouts.lora.with_lora` gives
the adapters of an FSDP2 layout (``model.layers.0.self_attn.q_proj.lora_A.weight``). The
layer computes what PEFT's ``lora.Linear`` computes::

    y = W x + b + lora_B(lora_A(dropout(x))) * (alpha / r)

Every parameter but the adapters is frozen (``requires_grad=False``). The adapters start
as PEFT starts them: ``lora_A`` by ``nn.Linear``'s own initialisation (Kaiming uniform,
``a = sqrt(5)``) from a generator seeded with ``seed``, ``lora_B`` zero, so the model
computes what it did before.

A fused expert parameter a configuration targets (``target_parameters``: transformers'
``mlp.experts.gate_up_proj`` ``[E, out, in]``) gets PEFT's pair beside it on the same
module, ``gate_up_proj_lora_A`` ``[E * r, in]`` and ``gate_up_proj_lora_B``
``[out, E * r]`` (the names :func:`~areal_fn.layouts.lora.with_lora` gives them); the
module's class becomes a subclass whose ``forward`` runs the original one with each
targeted parameter replaced by what PEFT's ``ParamWrapper`` computes for it::

    W + (alpha / r) * B_e @ A_e  for every expert e   (one torch.baddbmm)

with ``A_e = lora_A[e*r:(e+1)*r]`` and ``B_e = lora_B[:, e::E]``.

Under tensor parallelism the adapted layer takes one DTensor style
(:func:`lora_tp_plan`): a column-parallel base (``ColwiseParallel``) holds ``lora_A``
replicated and ``lora_B`` split like its rows; a row-parallel base holds ``lora_A``
split like its columns and ``lora_B`` replicated: the placements ``with_lora`` gives.
The adapter path then runs on DTensors beside the base layer, so DTensor sums the
input gradient of both (column-parallel) and the partial outputs of both (row-parallel).
"""

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement as TPlacement

from areal_fn.errors import LayoutError
from areal_fn.model.lora import LoraConfig, LoraExpertTarget, lora_expert_targets, lora_targets
from areal_fn.model.spec import ModelSpec
from areal_fn.typecheck import beartype

__all__ = [
    "LoraColwiseParallel",
    "LoraLinear",
    "LoraRowwiseParallel",
    "adapter_parameters",
    "inject_lora",
    "lora_tp_plan",
]


class LoraLinear(nn.Linear):
    """A linear layer with a LoRA adapter: ``W x + b + lora_B(lora_A(dropout(x))) * scaling``.

    Takes over ``base``'s ``weight`` and ``bias`` parameters (the same objects, frozen);
    ``lora_A`` and ``lora_B`` are bias-free ``nn.Linear`` children of rank ``rank``.
    """

    def __init__(
        self, base: nn.Linear, *, rank: int, alpha: float, dropout: float, seed: int
    ) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = alpha / rank
        device, dtype = base.weight.device, torch.float32
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=g)
            nn.init.zeros_(self.lora_B.weight)
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        a = self.lora_A.weight
        lora = self.lora_B(self.lora_A(self.lora_dropout(x.to(a.dtype))))
        return out + (lora * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        rank = self.lora_A.out_features
        return f"{super().extra_repr()}, rank={rank}, scaling={self.scaling}"


@beartype
def inject_lora(model: nn.Module, spec: ModelSpec, config: LoraConfig, *, seed: int = 0) -> None:
    """Replace (in place) every linear layer ``config`` targets in ``spec``'s transformers
    ``model`` by a :class:`LoraLinear`, and freeze every other parameter.

    The adapters of target ``i`` (checkpoint order) start from ``seed + i``, so every rank
    that injects into the same model gets the same adapters. ``LayoutError`` when a target's
    module is not an ``nn.Linear`` of the target's shape.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    for i, t in enumerate(lora_targets(spec, config)):
        path = t.base.removesuffix(".weight")
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child, None)
        if type(base) is not nn.Linear or tuple(base.weight.shape) != (
            t.out_features,
            t.in_features,
        ):
            raise LayoutError(
                f"LoRA target {path!r} is {type(base).__name__}, not an nn.Linear of shape "
                f"[{t.out_features}, {t.in_features}]; build the model from the spec's config"
            )
        layer = LoraLinear(
            base, rank=t.rank, alpha=float(config.alpha), dropout=config.dropout, seed=seed + i
        )
        setattr(parent, child, layer)
    first = len(lora_targets(spec, config))
    for i, x in enumerate(lora_expert_targets(spec, config)):
        _inject_experts(model, x, alpha=float(config.alpha), seed=seed + first + i)


class _LoraExperts(nn.Module):
    """The forward of an experts module with LoRA adapters on fused parameters (mixed into
    the module's own class by :func:`_inject_experts`)."""

    #: (parameter name, rank, experts, scaling) per adapted parameter
    lora_experts: tuple[tuple[str, int, int, float], ...] = ()

    def forward(self, *args: object, **kwargs: object) -> object:
        saved: dict[str, object] = {}
        try:
            for name, rank, experts, scaling in self.lora_experts:
                w = self._parameters[name]
                a = self._parameters[name + "_lora_A"]
                b = self._parameters[name + "_lora_B"]
                assert w is not None and a is not None and b is not None
                lhs = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1).to(w.dtype)
                rhs = a.reshape(experts, rank, a.shape[-1]).to(w.dtype)
                with torch.autocast(w.device.type, enabled=False):
                    merged = torch.baddbmm(w, lhs, rhs, alpha=scaling)
                saved[name] = w
                self._parameters[name] = merged  # type: ignore[assignment]  # read by forward
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(saved)  # type: ignore[arg-type]


_EXPERT_CLASSES: dict[type, type] = {}


def _inject_experts(model: nn.Module, x: LoraExpertTarget, *, alpha: float, seed: int) -> None:
    path, _, name = x.base.rpartition(".")
    module = model.get_submodule(path)
    w = module._parameters.get(name)
    shape = (x.experts, x.out_features, x.in_features)
    if w is None or tuple(w.shape) != shape:
        raise LayoutError(
            f"expert LoRA target {x.base!r} is not a parameter of shape {list(shape)} "
            f"({None if w is None else list(w.shape)}); build the model from the spec's config"
        )
    er = x.experts * x.rank
    a = nn.Parameter(torch.empty(er, x.in_features, device=w.device, dtype=torch.float32))
    b = nn.Parameter(torch.zeros(x.out_features, er, device=w.device, dtype=torch.float32))
    g = torch.Generator(device=w.device).manual_seed(seed)
    with torch.no_grad():  # as PEFT starts lora_A, an nn.Linear(in, E * r)'s weight
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    module.register_parameter(name + "_lora_A", a)
    module.register_parameter(name + "_lora_B", b)
    cls = type(module)
    if not issubclass(cls, _LoraExperts):
        if cls not in _EXPERT_CLASSES:
            _EXPERT_CLASSES[cls] = type(f"Lora{cls.__name__}", (_LoraExperts, cls), {})
        module.__class__ = _EXPERT_CLASSES[cls]
    assert isinstance(module, _LoraExperts)
    module.lora_experts = (*module.lora_experts, (name, x.rank, x.experts, alpha / x.rank))


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable parameters (the adapters after :func:`inject_lora`), by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


_PLACE: dict[str, dict[str, TPlacement]] = {
    "col": {"": TShard(0), "lora_A": TReplicate(), "lora_B": TShard(0)},
    "row": {"weight": TShard(1), "bias": TReplicate(), "lora_A": TShard(1), "lora_B": TReplicate()},
}


def _distribute(
    module: nn.Module, name: str, place: Mapping[str, TPlacement], mesh: object
) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        key = name if name else pname
        p = place.get(key, place.get(""))
        if p is None:
            raise LayoutError(f"LoRA layer: no tensor-parallel placement for {key!r}")
        dparam = nn.Parameter(
            distribute_tensor(param, mesh, [p]),  # type: ignore[arg-type]
            requires_grad=param.requires_grad,
        )
        module.register_parameter(pname, dparam)


class LoraColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` of a :class:`LoraLinear`: base and ``lora_B`` ``Shard(0)``,
    ``lora_A`` replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: object) -> None:
        _distribute(module, name, _PLACE["col"], device_mesh)


class LoraRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` of a :class:`LoraLinear`: base weight and ``lora_A``
    ``Shard(1)``, bias and ``lora_B`` replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: object) -> None:
        _distribute(module, name, _PLACE["row"], device_mesh)


def lora_tp_plan(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with each tensor-parallel :class:`LoraLinear` under one LoRA style (its
    adapters' own entries dropped). A replicated LoRA layer keeps its styles (each part
    replicated and computed locally)."""
    out = dict(plan)
    for mname, module in model.named_modules():
        if not isinstance(module, LoraLinear) or mname not in plan:
            continue
        style = plan[mname]
        if type(style) is ColwiseParallel:
            out[mname] = LoraColwiseParallel()
        elif type(style) is RowwiseParallel:
            out[mname] = LoraRowwiseParallel()
        else:
            continue
        for child in ("lora_A", "lora_B"):
            out.pop(f"{mname}.{child}", None)
    return out
