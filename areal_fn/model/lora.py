"""LoRA adapters as canonical tensors, named and shaped as PEFT saves them.

A :class:`LoraConfig` (target modules, rank ``r``, ``alpha``, dropout, optional
per-module ranks) turns a :class:`~areal_fn.model.spec.ModelSpec` into its frozen base
tensors plus two adapter tensors per targeted linear layer, named exactly as PEFT's
``save_pretrained`` writes them in ``adapter_model.safetensors``::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

(a linear ``y = W x`` gains ``(alpha / r) * B (A x)``). Adapters are float32, as PEFT
keeps them (it upcasts adapters of a bf16 or fp16 model).

A targeted module is a decoder layer's 2-D ``<module>.weight`` whose last name part is
in ``target_modules``. A MoE family takes attention modules there (PEFT turns
``gate_proj``/``up_proj``/``down_proj`` of a MoE model into adapters of its fused
experts); its routed experts are targeted by ``target_parameters``, PEFT's option of
the same name: transformers 5 holds a MoE layer's experts as two 3-D parameters,
``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (expert ``e`` is ``[gate_e; up_e]``) and
``mlp.experts.down_proj`` ``[E, H, I]`` (the family's ``fused_experts``), and PEFT
adapts such a ``[E, out, in]`` parameter with one pair for all experts::

    base_model.model.model.layers.0.mlp.experts.lora_A.weight   [E * r, in]
    base_model.model.model.layers.0.mlp.experts.lora_B.weight   [out, E * r]

Expert ``e``'s update is ``(alpha / r) * B_e A_e`` with ``A_e = lora_A[e*r:(e+1)*r]``
and ``B_e = lora_B[:, e::E]`` (PEFT's column ``j * E + e``). PEFT wraps the targeted
parameters of one module in the order the module registers them, each wrapper around
the last, so with both targeted ``gate_up_proj``'s pair is saved under
``mlp.experts.base_layer.lora_A.weight`` and ``down_proj``'s under
``mlp.experts.lora_A.weight`` (:class:`LoraExpertTarget`). PEFT refuses dropout on them.
Multi-token-prediction layers (which transformers does not build) are not targeted.

Layouts place the adapters beside their base layer: :mod:`areal_fn.layouts.lora`.
"""

import math
import re
from collections.abc import Iterable

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.families.lora_targets import ATTENTION_MODULES as ATTENTION_MODULES
from areal_fn.model.families.lora_targets import EXPERT_PARAMETERS as EXPERT_PARAMETERS
from areal_fn.model.families.lora_targets import MLP_MODULES as MLP_MODULES
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.typecheck import beartype

#: The prefix PEFT puts before a transformers parameter name in its saved adapter.
PEFT_PREFIX = "base_model.model."
#: Adapter tensors' dtype (PEFT's, whatever the base model's).
ADAPTER_DTYPE = "float32"
#: The module names a configuration may target.
MODULES = ATTENTION_MODULES + MLP_MODULES

_TARGET_RE = re.compile(r"^model\.layers\.(\d+)\.(.+\.)?([a-z_]+)\.weight$")


class LoraError(SpecError):
    """A LoRA configuration, or its application to a model, breaks a rule."""


def _modules(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise LoraError(
            f"LoraConfig.target_modules={value!r} must be a sequence of module names such as "
            "('q_proj', 'v_proj')"
        )
    out = tuple(value)
    for m in out:
        if m not in MODULES:
            raise LoraError(
                f"LoraConfig.target_modules has {m!r}, which is not a module LoRA targets here; "
                f"use names from {list(MODULES)}"
            )
    if len(set(out)) != len(out):
        raise LoraError(f"LoraConfig.target_modules={out!r} names a module twice; name each once")
    return out


def _parameters(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise LoraError(
            f"LoraConfig.target_parameters={value!r} must be a sequence of parameter names "
            f"such as {EXPERT_PARAMETERS!r}"
        )
    given = tuple(value)
    for p in given:
        if p not in EXPERT_PARAMETERS:
            raise LoraError(
                f"LoraConfig.target_parameters has {p!r}, which is not a parameter LoRA targets "
                f"here; use names from {list(EXPERT_PARAMETERS)} (a MoE layer's fused experts)"
            )
    if len(set(given)) != len(given):
        raise LoraError(
            f"LoraConfig.target_parameters={given!r} names a parameter twice; name each once"
        )
    return tuple(p for p in EXPERT_PARAMETERS if p in given)


def _ranks(value: object) -> tuple[tuple[str, int], ...]:
    pairs = tuple(value.items()) if isinstance(value, dict) else value
    if isinstance(pairs, str) or not isinstance(pairs, Iterable):
        raise LoraError(f"LoraConfig.module_ranks={value!r} must map module names to ranks")
    out = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str):
            raise LoraError(
                f"LoraConfig.module_ranks has {pair!r}; give (module name, rank) pairs or a dict "
                "such as {'q_proj': 16}"
            )
        out.append(pair)
    return tuple(sorted(out))


def _check_rank(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoraError(f"{what}={value!r} must be an int >= 1 (the adapter's rank r)")


@attrs.frozen(kw_only=True)
class LoraConfig:
    """A LoRA configuration: ``rank`` (PEFT's ``r``), ``alpha`` (``lora_alpha``; the
    update is scaled by ``alpha / rank``), ``dropout`` (``lora_dropout``, in [0, 1)),
    ``target_modules`` (module names, see :data:`MODULES`), ``module_ranks``
    (PEFT's ``rank_pattern`` by module name: ``(("q_proj", 16),)``) and
    ``target_parameters`` (routed experts' fused parameters, see
    :data:`EXPERT_PARAMETERS`; their adapters have rank ``rank``)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = attrs.field(
        default=MODULES[:4] + MLP_MODULES, converter=_modules
    )
    module_ranks: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_ranks)
    target_parameters: tuple[str, ...] = attrs.field(default=(), converter=_parameters)

    def __attrs_post_init__(self) -> None:
        _check_rank("LoraConfig.rank", self.rank)
        if not self.target_modules and not self.target_parameters:
            raise LoraError(
                "LoraConfig.target_modules is empty (and so is target_parameters); name at "
                "least one module"
            )
        alpha = self.alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, int | float)
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            raise LoraError(f"LoraConfig.alpha={alpha!r} must be a finite number > 0 (lora_alpha)")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < 1:
            raise LoraError(f"LoraConfig.dropout={d!r} must be a number in [0, 1) (lora_dropout)")
        if d and self.target_parameters:
            raise LoraError(
                f"LoraConfig.dropout={d!r} with target_parameters={list(self.target_parameters)}: "
                "an expert adapter folds into its weight, so no dropout can reach its input "
                "(PEFT refuses it too); use dropout=0"
            )
        for module, r in self.module_ranks:
            if module not in self.target_modules:
                raise LoraError(
                    f"LoraConfig.module_ranks gives {module!r} a rank, but target_modules="
                    f"{self.target_modules!r} does not name it; target it or drop its rank"
                )
            _check_rank(f"LoraConfig.module_ranks[{module!r}]", r)
        if len({m for m, _ in self.module_ranks}) != len(self.module_ranks):
            raise LoraError("LoraConfig.module_ranks names a module twice; give each one rank")

    def rank_of(self, module: str) -> int:
        """The rank of ``module``'s adapters (its own, else ``rank``)."""
        return dict(self.module_ranks).get(module, self.rank)


@attrs.frozen(kw_only=True)
class LoraTarget:
    """One targeted linear layer: its base weight (canonical name, ``[out, in]``), its
    module name, its adapters' rank and canonical names."""

    base: str
    module: str
    rank: int
    out_features: int
    in_features: int

    @property
    def lora_a(self) -> str:
        return PEFT_PREFIX + self.base.removesuffix(".weight") + ".lora_A.weight"

    @property
    def lora_b(self) -> str:
        return PEFT_PREFIX + self.base.removesuffix(".weight") + ".lora_B.weight"

    @property
    def tensors(self) -> tuple[TensorSpec, TensorSpec]:
        """``(lora_A [r, in], lora_B [out, r])``."""
        return (
            TensorSpec(name=self.lora_a, shape=(self.rank, self.in_features), dtype=ADAPTER_DTYPE),
            TensorSpec(name=self.lora_b, shape=(self.out_features, self.rank), dtype=ADAPTER_DTYPE),
        )


@attrs.frozen(kw_only=True)
class LoraExpertTarget:
    """One targeted fused expert parameter of a MoE layer: ``base`` (transformers'
    in-memory name, ``[experts, out, in]``), ``parameter`` (its name in
    :data:`EXPERT_PARAMETERS`), ``parts`` (the canonical weights it fuses, expert-major),
    the adapters' rank, and ``inner``: how many of PEFT's wrappers of the same module sit
    inside this one (each adds ``base_layer.`` to the saved names)."""

    base: str
    parameter: str
    parts: tuple[str, ...]
    rank: int
    experts: int
    out_features: int
    in_features: int
    inner: int

    @property
    def _stem(self) -> str:
        module = self.base.rpartition(".")[0]
        return PEFT_PREFIX + module + ".base_layer" * self.inner

    @property
    def lora_a(self) -> str:
        return self._stem + ".lora_A.weight"

    @property
    def lora_b(self) -> str:
        return self._stem + ".lora_B.weight"

    @property
    def tensors(self) -> tuple[TensorSpec, TensorSpec]:
        """``(lora_A [experts * r, in], lora_B [out, experts * r])``, PEFT's shapes."""
        er = self.experts * self.rank
        return (
            TensorSpec(name=self.lora_a, shape=(er, self.in_features), dtype=ADAPTER_DTYPE),
            TensorSpec(name=self.lora_b, shape=(self.out_features, er), dtype=ADAPTER_DTYPE),
        )


@beartype
def default_targets(model: ModelSpec) -> tuple[str, ...]:
    """The modules ``areal-fn plan --lora-rank`` targets: every attention projection the
    model has, and ``gate_proj``/``up_proj``/``down_proj`` in a dense family."""
    found = {m.group(3) for t in model.tensors if (m := _TARGET_RE.match(t.name))}
    allowed = ATTENTION_MODULES if model.family.moe else MODULES
    return tuple(m for m in allowed if m in found)


@beartype
def lora_targets(model: ModelSpec, config: LoraConfig) -> tuple[LoraTarget, ...]:
    """The linear layers ``config`` targets in ``model``, in checkpoint order.

    ``LoraError`` for an MLP module of a MoE family and for a module the model lacks.
    """
    if model.family.moe:
        mlp = [m for m in config.target_modules if m in MLP_MODULES]
        if mlp:
            raise LoraError(
                f"target_modules names {mlp} in {model.model_type}, a MoE family: PEFT makes "
                "them adapters of the fused routed experts; target attention modules there "
                f"({list(default_targets(model))}) and the routed experts with "
                f"target_parameters={list(EXPERT_PARAMETERS)}"
            )
    out: list[LoraTarget] = []
    for t in model.tensors:
        m = _TARGET_RE.match(t.name)
        if m is None or m.group(3) not in config.target_modules or len(t.shape) != 2:
            continue
        if int(m.group(1)) >= model.num_layers or ".experts." in t.name:
            continue  # multi-token prediction layers and routed experts
        out.append(
            LoraTarget(
                base=t.name,
                module=m.group(3),
                rank=config.rank_of(m.group(3)),
                out_features=t.shape[0],
                in_features=t.shape[1],
            )
        )
    lora_expert_targets(model, config)  # its refusals too, before any layer is built
    missing = [mod for mod in config.target_modules if not any(x.module == mod for x in out)]
    if missing:
        raise LoraError(
            f"target_modules names {missing}, which {model.model_type} has no linear layer of; "
            f"its modules LoRA can target: {list(default_targets(model))}"
        )
    return tuple(out)


@beartype
def lora_expert_targets(model: ModelSpec, config: LoraConfig) -> tuple[LoraExpertTarget, ...]:
    """The fused expert parameters ``config.target_parameters`` targets in ``model``, by
    layer, then in :data:`EXPERT_PARAMETERS` order.

    ``LoraError`` for a family whose transformers model keeps no such fused parameter.
    """
    if not config.target_parameters:
        return ()
    fused = {f.name: f for f in model.family.fused_experts}
    lacking = [p for p in config.target_parameters if p not in fused]
    if lacking:
        raise LoraError(
            f"target_parameters names {lacking}; expert adapters are built where transformers "
            "fuses a MoE layer's per-expert checkpoint weights into [E, out, in] parameters, "
            f"and {model.model_type} has {sorted(fused) or 'none'} of those: drop "
            "target_parameters or use those names"
        )
    shapes = {t.name: t.shape for t in model.tensors}
    out: list[LoraExpertTarget] = []
    for layer in range(model.num_layers):
        prefix = f"model.layers.{layer}."
        for i, name in enumerate(config.target_parameters):
            parts = fused[name].parts
            if prefix + parts[0].format(e=0) not in shapes:
                continue  # a dense layer
            names = tuple(prefix + p.format(e=e) for e in range(model.num_experts) for p in parts)
            rows = sum(shapes[prefix + p.format(e=0)][0] for p in parts)
            out.append(
                LoraExpertTarget(
                    base=prefix + name,
                    parameter=name,
                    parts=names,
                    rank=config.rank,
                    experts=model.num_experts,
                    out_features=rows,
                    in_features=shapes[names[0]][1],
                    inner=len(config.target_parameters) - 1 - i,
                )
            )
    return tuple(out)


@beartype
def lora_tensors(model: ModelSpec, config: LoraConfig) -> tuple[TensorSpec, ...]:
    """The adapter tensors (PEFT's names and shapes), per target ``lora_A`` then ``lora_B``:
    the linear layers in checkpoint order, then the fused experts by layer."""
    linear = tuple(s for t in lora_targets(model, config) for s in t.tensors)
    return linear + tuple(s for t in lora_expert_targets(model, config) for s in t.tensors)


@beartype
def lora_param_count(model: ModelSpec, config: LoraConfig) -> int:
    """Adapter elements: ``r * (in + out)`` summed over the linear targets, and
    ``experts * r * (in + out)`` over the expert targets."""
    linear = sum(t.rank * (t.in_features + t.out_features) for t in lora_targets(model, config))
    return linear + sum(
        t.experts * t.rank * (t.in_features + t.out_features)
        for t in lora_expert_targets(model, config)
    )
