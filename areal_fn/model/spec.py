"""`ModelSpec`: a model's architecture fields and its canonical tensors, from ``config.json``.

Canonical tensors are the Hugging Face *checkpoint* tensors: their names, full shapes
and dtype exactly as ``save_pretrained`` writes them (MoE experts one tensor per
expert, tied models without ``lm_head.weight``).

**Checkpoint order.** Safetensors files hold their tensors sorted by name
(``layers.10`` before ``layers.2``), which is not a useful order. ``ModelSpec.tensors``
is in *state-dict order*: the order of ``model.state_dict()`` of the transformers 5
model (module registration order: embeddings, then per layer attention, MLP and norms,
then the final norm and ``lm_head``), where each group of fused expert tensors of a
layer is replaced, at the position of its first member, by the per-expert tensors
expert-major (``experts.0.gate_proj``, ``experts.0.up_proj``, ``experts.0.down_proj``,
``experts.1.gate_proj``, ...).

:func:`model_from_hf_config` reads the config dict with :mod:`areal_fn.model.hf_config`.
"""

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.model import linear_attention as lin
from areal_fn.model.dims import condition_flags as condition_flags
from areal_fn.model.dims import dim_sizes as dim_sizes
from areal_fn.model.dsa import layer_flags
from areal_fn.model.embedded import resolve_config
from areal_fn.model.families import FAMILIES, Family, family
from areal_fn.model.families.mapping import layer_tensors
from areal_fn.model.families.tp_role import TpRole
from areal_fn.model.hf_config import ROPE_TYPES as ROPE_TYPES
from areal_fn.model.hf_config import _positive_float, _rope_pairs, _spec_fields
from areal_fn.model.layer_types import layer_type_config
from areal_fn.model.mla import mla_config
from areal_fn.model.mtp import MTP_KEY, mtp_shapes
from areal_fn.model.routing import ROUTER_SCORES as ROUTER_SCORES
from areal_fn.model.spec_rules import check_model
from areal_fn.model.tensor_spec import TensorSpec, dtype_name
from areal_fn.model.tensor_spec import layer_of as layer_of
from areal_fn.typecheck import beartype

# -- field converters and validators --------------------------------------------------


def _check_model_type(_inst: object, _attr: object, value: str) -> None:
    if not isinstance(value, str):
        raise SpecError(f"ModelSpec.model_type={value!r} must be a string such as 'qwen2'")
    family(value)


def _int_at_least(minimum: int) -> Callable[[object, "attrs.Attribute[int]", int], None]:
    def check(_inst: object, attr: "attrs.Attribute[int]", value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"ModelSpec.{attr.name}={value!r} must be an int >= {minimum}")

    return check


def _check_bool(_inst: object, attr: "attrs.Attribute[bool]", value: bool) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"ModelSpec.{attr.name}={value!r} must be a bool (true/false)")


def _bools_of(field: str) -> Callable[[object], tuple[bool, ...]]:
    def convert(value: object) -> tuple[bool, ...]:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise SpecError(f"ModelSpec.{field}={value!r} must be a sequence of bools")
        out = tuple(value)
        for v in out:
            if not isinstance(v, bool):
                raise SpecError(f"ModelSpec.{field} has {v!r}; every entry must be a bool")
        return out

    return convert


_moe_converter = _bools_of("moe_layers")
_sliding_converter = _bools_of("sliding_layers")
_indexer_converter = _bools_of("indexer_layers")


def _bools(value: object) -> tuple[bool, ...]:
    return _moe_converter(value)


def _sliding_bools(value: object) -> tuple[bool, ...]:
    return _sliding_converter(value)


def _indexer_bools(value: object) -> tuple[bool, ...]:
    return _indexer_converter(value)


def _optional_float(value: object) -> float | None:
    return None if value is None else _positive_float(value)


_pos = _int_at_least(1)
_nonneg = _int_at_least(0)


@attrs.frozen(kw_only=True)
class ModelSpec:
    """Architecture of a decoder-only LM plus its canonical (checkpoint) tensors.

    Build one with :func:`model_from_hf_config`; ``tensors`` lists the checkpoint tensors
    in state-dict order (see the module docstring).

    Field notes: ``num_layers`` is ``num_hidden_layers``; ``qkv_bias`` / ``o_bias`` /
    ``mlp_bias`` say which linear layers carry a bias; ``qk_norm`` adds per-head
    ``q_norm``/``k_norm`` weights; ``rope_scaling`` holds the rope-scaling entries as
    sorted ``(key, value)`` pairs (empty for plain RoPE); ``moe_layers[i]`` is True when
    layer ``i`` has routed experts. Dense families have ``num_experts ==
    num_experts_per_tok == moe_intermediate_size == 0`` and all-``False`` ``moe_layers``.
    ``dtype`` is the config's ``torch_dtype`` (``bfloat16`` when absent). MoE routing:
    ``router_score`` (``softmax`` or ``sigmoid``), ``router_bias`` (a per-expert score
    correction added for the choice only, DeepSeek/GLM's ``e_score_correction_bias``),
    group-limited top-k over ``router_groups`` groups keeping ``router_group_topk``,
    the weights scaled by ``routed_scaling_factor``; ``num_shared_experts`` shared
    experts of ``moe_intermediate_size`` each, fused into one MLP. ``rotary_fraction``:
    the fraction of each head's dims that RoPE rotates (GLM: 0.5). Multi-latent
    attention (DeepSeek-V3, Kimi-K2): ``head_dim`` is the query/key head size
    ``qk_nope_head_dim + qk_rope_head_dim``; ``q_lora_rank`` (0: queries projected
    directly by ``q_proj``), ``kv_lora_rank``, ``qk_rope_head_dim`` and ``v_head_dim`` as
    in the config, ``rope_interleave`` as transformers applies it; ``num_key_value_heads
    == num_attention_heads`` (there are no shared KV heads). Other families have these
    fields at 0 (and ``rope_interleave`` true). Sliding windows (gpt-oss):
    ``sliding_layers[i]`` is True when layer ``i`` attends to the last ``sliding_window``
    tokens only (empty, and ``sliding_window`` 0, for families without them; gpt-oss
    always has a window, whether or not a layer slides). Clamped
    SwiGLU experts (gpt-oss): ``swiglu_alpha`` and ``swiglu_limit`` (``None`` elsewhere).
    ``mtp_layers``: multi-token-prediction layers held as canonical tensors after the
    others (:mod:`areal_fn.model.mtp`; 0 unless read with ``mtp=True``). Gemma 3:
    ``rope_local_theta`` the sliding layers' rope base (``None`` elsewhere: one base),
    ``query_pre_attn_scalar`` the attention scale's ``d`` in ``d ** -0.5`` (0 elsewhere:
    ``head_dim``). Qwen3-Next, Qwen3.5: ``linear_attention`` and ``shared_expert_size``
    (:mod:`areal_fn.model.linear_attention`; ``None`` and 0 elsewhere). DeepSeek sparse
    attention (:mod:`areal_fn.model.dsa`): the indexer's ``index_n_heads``,
    ``index_head_dim``, ``index_topk``; ``indexer_layers[i]`` is True when layer ``i``
    runs its own indexer (0 and empty elsewhere).
    """

    model_type: str = attrs.field(validator=_check_model_type)
    hidden_size: int = attrs.field(validator=_pos)
    num_layers: int = attrs.field(validator=_pos)
    num_attention_heads: int = attrs.field(validator=_pos)
    num_key_value_heads: int = attrs.field(validator=_pos)
    head_dim: int = attrs.field(validator=_pos)
    intermediate_size: int = attrs.field(validator=_pos)
    vocab_size: int = attrs.field(validator=_pos)
    max_position_embeddings: int = attrs.field(validator=_pos)
    tie_word_embeddings: bool = attrs.field(validator=_check_bool)
    qkv_bias: bool = attrs.field(validator=_check_bool)
    o_bias: bool = attrs.field(validator=_check_bool)
    mlp_bias: bool = attrs.field(validator=_check_bool)
    qk_norm: bool = attrs.field(validator=_check_bool)
    rms_norm_eps: float = attrs.field(converter=_positive_float)
    rope_theta: float = attrs.field(converter=_positive_float)
    rope_scaling: tuple[tuple[str, object], ...] = attrs.field(default=(), converter=_rope_pairs)
    num_experts: int = attrs.field(default=0, validator=_nonneg)
    num_experts_per_tok: int = attrs.field(default=0, validator=_nonneg)
    moe_intermediate_size: int = attrs.field(default=0, validator=_nonneg)
    norm_topk_prob: bool = attrs.field(default=False, validator=_check_bool)
    num_shared_experts: int = attrs.field(default=0, validator=_nonneg)
    router_score: str = attrs.field(
        default="softmax", validator=attrs.validators.in_(ROUTER_SCORES)
    )
    router_bias: bool = attrs.field(default=False, validator=_check_bool)
    router_groups: int = attrs.field(default=1, validator=_pos)
    router_group_topk: int = attrs.field(default=1, validator=_pos)
    routed_scaling_factor: float = attrs.field(default=1.0, converter=_positive_float)
    rotary_fraction: float = attrs.field(default=1.0, converter=_positive_float)
    q_lora_rank: int = attrs.field(default=0, validator=_nonneg)
    kv_lora_rank: int = attrs.field(default=0, validator=_nonneg)
    qk_rope_head_dim: int = attrs.field(default=0, validator=_nonneg)
    v_head_dim: int = attrs.field(default=0, validator=_nonneg)
    rope_interleave: bool = attrs.field(default=True, validator=_check_bool)
    moe_layers: tuple[bool, ...] = attrs.field(converter=_bools)
    dtype: str = attrs.field(default="bfloat16", converter=dtype_name)
    sliding_window: int = attrs.field(default=0, validator=_nonneg)
    sliding_layers: tuple[bool, ...] = attrs.field(default=(), converter=_sliding_bools)
    swiglu_alpha: float | None = attrs.field(default=None, converter=_optional_float)
    swiglu_limit: float | None = attrs.field(default=None, converter=_optional_float)
    mtp_layers: int = attrs.field(default=0, validator=_nonneg)
    rope_local_theta: float | None = attrs.field(default=None, converter=_optional_float)
    query_pre_attn_scalar: int = attrs.field(default=0, validator=_nonneg)
    index_n_heads: int = attrs.field(default=0, validator=_nonneg)
    index_head_dim: int = attrs.field(default=0, validator=_nonneg)
    index_topk: int = attrs.field(default=0, validator=_nonneg)
    indexer_layers: tuple[bool, ...] = attrs.field(default=(), converter=_indexer_bools)
    linear_attention: lin.LinearAttention | None = attrs.field(default=None, validator=lin.check)
    shared_expert_size: int = attrs.field(default=0, validator=_nonneg)

    def __attrs_post_init__(self) -> None:
        check_model(self)

    # -- derived ----------------------------------------------------------------------
    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @functools.cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Canonical checkpoint tensors, in state-dict order."""
        return tuple(
            TensorSpec(name=name, shape=shape, dtype=dtype or self.dtype)
            for name, shape, dtype in _canonical_shapes(self)
        )

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def mtp_layer_ids(self) -> range:
        """The layer index of every multi-token-prediction layer: the ones after the
        decoder layers (empty without them)."""
        return range(self.num_layers, self.num_layers + self.mtp_layers)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def num_params(self) -> int:
        """Parameters counted once (tied embeddings once), = sum of canonical numels."""
        return sum(t.numel for t in self.tensors)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: :attr:`num_params` less, in every MoE layer, the
        routed experts it does not pick (``num_experts - num_experts_per_tok`` of them)."""
        idle = self.num_experts - self.num_experts_per_tok
        if not self.is_moe or idle <= 0:
            return self.num_params
        expert0 = [n for n, _ in _per_expert_names(self)]
        per_expert = sum(self.tensor(n).numel for n in expert0)
        stacked = sum(self.tensor(n).numel for n in _stacked_names(self))
        return self.num_params - idle * (per_expert + stacked // self.num_experts)

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def has_sinks(self) -> bool:
        """Attention sinks: one learnt softmax logit per head (gpt-oss ``self_attn.sinks``):
        the family's table has a tensor split with the heads (``TpRole.HEAD``)."""
        return any(r.tp is TpRole.HEAD for r in self.family.canonical)

    @property
    def has_expert_biases(self) -> bool:
        """The routed experts have biases (gpt-oss), which Megatron-Core refuses to shard
        over expert tensor parallelism."""
        return any(".experts." in r.name and "bias" in r.name for r in self.family.canonical)

    @property
    def is_sliding(self) -> bool:
        """Some layer attends to a sliding window (:attr:`sliding_layers`)."""
        return any(self.sliding_layers)

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (the family's ``mla``)."""
        return self.family.mla

    @property
    def q_direct(self) -> bool:
        """Multi-latent attention whose queries come from ``q_proj`` (no query LoRA)."""
        return self.is_mla and self.q_lora_rank == 0

    @property
    def k_width(self) -> int:
        """Key features per token: ``num_key_value_heads * head_dim`` (multi-latent
        attention: every head's key, ``num_attention_heads * head_dim``)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def v_width(self) -> int:
        """Value features per token (and the attention output's width for MLA):
        ``num_key_value_heads * head_dim``, multi-latent ``num_attention_heads * v_head_dim``."""
        if self.is_mla:
            return self.num_attention_heads * self.v_head_dim
        return self.num_key_value_heads * self.head_dim

    @property
    def qk_nope_head_dim(self) -> int:
        """The query/key head dims without rotary embedding (multi-latent attention)."""
        return self.head_dim - self.qk_rope_head_dim if self.is_mla else 0

    @beartype
    def is_moe_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return self.moe_layers[layer]

    @beartype
    def tensor(self, name: str) -> TensorSpec:
        """The canonical tensor called ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            near = [
                n for n in self.tensor_names if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]
            ]
            hint = f"; similar names: {near[:3]}" if near else ""
            raise SpecError(
                f"{self.model_type} model has no tensor {name!r} among its "
                f"{len(self.tensors)} canonical tensors{hint}; names are HF checkpoint names "
                f"such as 'model.layers.0.self_attn.q_proj.weight'"
            ) from None

    @functools.cached_property
    def _by_layer(self) -> tuple[tuple[TensorSpec, ...], ...]:
        layers: list[list[TensorSpec]] = [[] for _ in range(self.num_layers)]
        for t in self.tensors:
            i = layer_of(t.name)
            if i is not None and i < self.num_layers:  # not an MTP layer
                layers[i].append(t)
        return tuple(tuple(ts) for ts in layers)

    @beartype
    def layer_tensors(self, layer: int) -> tuple[TensorSpec, ...]:
        """Canonical tensors of decoder layer ``layer`` (state-dict order)."""
        self._check_layer(layer)
        return self._by_layer[layer]

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise SpecError(
                f"layer={layer!r} is out of range; the model has num_layers={self.num_layers} "
                f"(valid 0..{self.num_layers - 1})"
            )

    def hf_config(self) -> dict[str, object]:
        """A ``config.json`` dict that :func:`model_from_hf_config` maps back to this spec."""
        fam = self.family
        cfg: dict[str, object] = {
            "architectures": [fam.architecture],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": {
                k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling
            }
            or ({"rope_type": "default"} if fam.has_default("rope_scaling") else None),
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        for key, fields in fam.bias_flags:
            cfg[key] = getattr(self, fields[0])
        if fam.moe:
            foreign = dict(fam.foreign_keys)
            moe: dict[str, object] = {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, m in enumerate(self.moe_layers) if not m],
                "norm_topk_prob": self.norm_topk_prob,
            }
            if "num_experts" in foreign:
                key = dict(fam.key_sources).get("num_experts", "num_local_experts")
                moe[key] = moe["num_experts"]
            for field, key in fam.moe_keys:
                moe[key] = getattr(self, field)
            if fam.first_k_dense:
                moe[fam.first_k_dense] = self.moe_layers.index(True)
            cfg.update({k: v for k, v in moe.items() if k not in foreign})
        if fam.partial_rotary:
            cfg["partial_rotary_factor"] = self.rotary_fraction
        if fam.mla:
            cfg.update(mla_config(self))
        if fam.sliding_window == "when_set":
            cfg["sliding_window"] = None
        if fam.clamped_swiglu:
            cfg["swiglu_alpha"], cfg["swiglu_limit"] = self.swiglu_alpha, self.swiglu_limit
        cfg = lin.linear_config(self, layer_type_config(self, cfg))
        if fam.mtp:
            cfg[MTP_KEY] = self.mtp_layers
        return dict(sorted(cfg.items()))


# -- canonical tensors ----------------------------------------------------------------


def _moe_indices(spec: ModelSpec) -> list[int]:
    """The index of every layer with routed experts, MTP layers included."""
    mtp = spec.mtp_layer_ids if spec.family.moe else ()
    return [i for i, m in enumerate(spec.moe_layers) if m] + list(mtp)


def _per_expert_names(spec: ModelSpec) -> list[tuple[str, int]]:
    """Expert 0's canonical tensors in every MoE layer, with the layer index."""
    out = []
    for i in _moe_indices(spec):
        out += [
            (f"model.layers.{i}." + r.name.format(e=0), i)
            for r in spec.family.canonical
            if r.expert
        ]
    return out


def _stacked_names(spec: ModelSpec) -> list[str]:
    """The stacked expert tensors (every expert along dim 0) of every MoE layer."""
    rows = [r for r in spec.family.canonical if r.stacked]
    return [f"model.layers.{i}.{r.name}" for i in _moe_indices(spec) for r in rows]


def _canonical_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], str | None]]:
    """The embedding, each decoder layer from the family's canonical table, the final
    norm and the (untied) output layer."""
    hid = spec.hidden_size
    sizes = dim_sizes(spec)
    flags = condition_flags(spec)
    table = spec.family.canonical
    out: list[tuple[str, tuple[int, ...], str | None]] = [
        (spec.family.outer.embedding, (spec.vocab_size, hid), None)
    ]
    for i in range(spec.num_layers):
        out += layer_tensors(
            table,
            f"model.layers.{i}.",
            moe=spec.moe_layers[i],
            flags=layer_flags(spec, flags, i),
            sizes=sizes,
            num_experts=spec.num_experts,
            linear=lin.is_linear_layer(spec, i),
        )
    out.append((spec.family.outer.final_norm, (hid,), None))
    if not spec.tie_word_embeddings:
        out.append((spec.family.outer.output, (spec.vocab_size, hid), None))
    return out + mtp_shapes(
        table,
        spec.family.mtp,
        num_layers=spec.num_layers,
        mtp_layers=spec.mtp_layers,
        vocab=spec.vocab_size,
        hidden=hid,
        moe=spec.family.moe,
        flags=flags,
        sizes=sizes,
        num_experts=spec.num_experts,
    )


# -- config.json -> ModelSpec ---------------------------------------------------------


@beartype
def load_hf_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a ``config.json`` (or the ``config.json`` inside a directory, or an embedded
    model named as :func:`~areal_fn.model.embedded.resolve_config` says) into a dict."""
    p = resolve_config(os.fspath(path))
    if isinstance(p, dict):
        return p
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{str(p)!r} is not valid JSON ({exc}); pass an HF config.json") from None
    if not isinstance(data, dict):
        raise SpecError(f"{str(p)!r} holds a JSON {type(data).__name__}, not an object")
    return data


@beartype
def model_from_hf_config(
    config: str | os.PathLike[str] | Mapping[str, object], *, mtp: bool = False
) -> ModelSpec:
    """The :class:`ModelSpec` of an HF ``config.json`` (a dict, a file, or a directory).

    ``mtp=True`` adds the config's ``num_nextn_predict_layers`` multi-token-prediction
    layers to the canonical tensors (DeepSeek-V3, GLM-4.5; :mod:`areal_fn.model.mtp`);
    by default the spec is the model transformers builds, which has none. Then
    ``model_from_hf_config(spec.hf_config(), mtp=spec.mtp_layers > 0) == spec``.

    Required keys missing, an unsupported ``model_type`` or inconsistent sizes raise a
    :class:`SpecError` naming the key, the value and the rule. Keys that would change what
    the model computes in a way the family does not model raise
    :class:`~areal_fn.errors.UnsupportedConfigError`: ``hidden_act`` other than the
    family's (``silu``), sliding-window attention turned on for some layer, a
    ``layer_types`` entry other than full (or disabled sliding) attention, a rope type
    outside :data:`ROPE_TYPES`, ``partial_rotary_factor`` other than 1. Other keys are
    ignored: token ids, ``transformers_version``, ``initializer_range``, ``use_cache``,
    dropout rates (the engines train without dropout), router loss settings, ...
    """
    if isinstance(config, Mapping):
        return _from_mapping(config, mtp)
    source = str(config)
    data = load_hf_config(config)
    try:
        return _from_mapping(data, mtp)
    except SpecError as exc:
        raise type(exc)(f"{source}: {exc}") from None


def _from_mapping(raw: Mapping[str, object], mtp: bool) -> ModelSpec:
    return ModelSpec(**_spec_fields(raw, mtp=mtp))  # type: ignore[arg-type]
