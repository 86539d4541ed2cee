"""An HF ``config.json`` dict read into the fields of a :class:`~areal_fn.model.spec.ModelSpec`.

:func:`_spec_fields` is what :func:`~areal_fn.model.spec.model_from_hf_config` builds
its spec from: typed reads with the family's defaults and the aliases transformers 5
writes (:class:`_Config`), rope parameters from the legacy keys or
``rope_parameters``, MoE layers from ``decoder_sparse_step`` and ``mlp_only_layers``,
and the refusal of keys that change what the model computes in a way the family does
not model (:class:`~areal_fn.errors.UnsupportedConfigError`). The value conversions
(:func:`_positive_float`, :func:`_rope_pairs`) are the ones ``ModelSpec``'s fields use,
so a spec written by hand and one read from a config agree.
"""

import math
from collections.abc import Mapping, Sequence

from areal_fn.errors import SpecError, UnsupportedConfigError
from areal_fn.model.families import FAMILIES, MODEL_TYPE_ALIASES, Family, family
from areal_fn.model.layer_types import sliding_fields, split_layer_rope
from areal_fn.model.linear_attention import (
    check_layer_kinds,
    linear_fields,
    text_config,
    without_rope_keys,
)
from areal_fn.model.mla import mla_fields
from areal_fn.model.mtp import MTP_KEY
from areal_fn.model.tensor_spec import dtype_name

__all__ = ["ROPE_TYPES"]

#: Rope types (``rope_scaling`` / ``rope_parameters`` ``rope_type``) with an implementation
#: in transformers, which the FSDP2 engine builds from ``hf_config()``; the Megatron builder
#: applies ``llama3`` only (:func:`areal_fn.runtime.megatron.build.rope_kwargs`).
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")

#: Other names a config may use for a key (transformers 5 writes the second form).
_ALIASES = (("num_experts", "num_local_experts"), ("torch_dtype", "dtype"))


# -- value conversions (shared with ModelSpec's fields) ------------------------------


def _positive_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"value {value!r} must be a number > 0")
    out = float(value)
    if not math.isfinite(out) or out <= 0:
        raise SpecError(f"value {value!r} must be a finite number > 0")
    return out


def _rope_value(key: str, value: object) -> object:
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Sequence):
        items = tuple(value)
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in items):
            return items
    raise SpecError(
        f"rope_scaling[{key!r}]={value!r} is not a number, string, bool or list of numbers"
    )


def _rope_pairs(value: object) -> tuple[tuple[str, object], ...]:
    """A rope-scaling mapping (or pairs) as sorted ``(key, value)`` pairs; lists become tuples.

    The legacy key ``type`` is read as ``rope_type``.
    """
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items: list[object] = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
    else:
        raise SpecError(f"rope_scaling={value!r} must be a mapping or null")
    out: dict[str, object] = {}
    for item in items:
        if not isinstance(item, Sequence) or len(item) != 2 or not isinstance(item[0], str):
            raise SpecError(f"rope_scaling={value!r} must map string keys to values")
        key = "rope_type" if item[0] == "type" else item[0]
        out[key] = _rope_value(key, item[1])
    return tuple(sorted(out.items()))


# -- config.json -> ModelSpec fields -------------------------------------------------


class _Config:
    """Typed reads of one family's config dict (defaults, aliases, error wording)."""

    def __init__(self, raw: Mapping[str, object], fam: Family) -> None:
        cfg = dict(raw)
        for key, instead in fam.foreign_keys:
            if cfg.get(key) is not None:
                raise UnsupportedConfigError(
                    f"{fam.model_type} config sets {key}={cfg[key]!r}, which transformers' "
                    f"{fam.model_type} config class does not have (it would be ignored); "
                    f"remove it and use {instead}"
                )
        for name, alias in _ALIASES:
            a, b = cfg.get(name), cfg.get(alias)
            if a is not None and b is not None and a != b:
                raise SpecError(
                    f"config sets both {name}={a!r} and {alias}={b!r}; they name the same "
                    f"field, keep one"
                )
            if a is None and b is not None:
                cfg[name] = b
        missing = [k for k in fam.required if cfg.get(k) is None]
        if missing:
            raise SpecError(
                f"{fam.model_type} config is missing required field(s) {missing}; a "
                f"{fam.model_type} config.json needs {list(fam.required)}"
            )
        self.cfg, self.fam = cfg, fam

    def get(self, key: str) -> object:
        value = self.cfg.get(key)
        source = dict(self.fam.key_sources).get(key)
        if value is None and source is not None:
            return self.get(source)
        if value is None and self.fam.has_default(key):
            return self.fam.default(key)
        return value

    def integer(self, key: str, minimum: int = 1) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"{key}={value!r} must be an int >= {minimum}")
        return value

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise SpecError(f"{key}={value!r} must be true or false")
        return value

    def number(self, key: str, value: object) -> float:
        try:
            return _positive_float(value)
        except SpecError:
            raise SpecError(f"{key}={value!r} must be a finite number > 0") from None


def _rope(c: _Config) -> tuple[float, tuple[tuple[str, object], ...]]:
    """``rope_theta`` and rope scaling from the legacy keys or transformers 5 ``rope_parameters``."""
    params = c.cfg.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise SpecError(f"rope_parameters={params!r} must be a mapping or null")
    params = dict(params or {})
    theta, p_theta = c.cfg.get("rope_theta"), params.pop("rope_theta", None)
    if theta is not None and p_theta is not None and theta != p_theta:
        raise SpecError(
            f"config sets rope_theta={theta!r} and rope_parameters.rope_theta={p_theta!r}; "
            f"they must agree"
        )
    if theta is None:
        theta = p_theta if p_theta is not None else c.get("rope_theta")
    legacy = c.cfg.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, Mapping):
        raise SpecError(f"rope_scaling={legacy!r} must be a mapping or null")
    if legacy is None and not c.cfg.get("rope_parameters") and c.fam.has_default("rope_scaling"):
        legacy = c.fam.default("rope_scaling")  # the config class's rope when it names none
    scaling = _rope_pairs(legacy if legacy else params)
    if c.fam.partial_rotary:  # read into rotary_fraction by _rotary_fraction
        scaling = tuple((k, v) for k, v in scaling if k != "partial_rotary_factor")
    if scaling == (("rope_type", "default"),):
        scaling = ()
    _check_full_rotary(
        c, "rope scaling partial_rotary_factor", dict(scaling).get("partial_rotary_factor")
    )
    kind = dict(scaling).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise UnsupportedConfigError(
            f"{c.fam.model_type} config has rope scaling rope_type={kind!r}, which the "
            f"{c.fam.model_type} family does not model; known rope types are {list(ROPE_TYPES)} "
            f"(transformers' implementations, which the FSDP2 engine applies; the Megatron "
            f"builder applies 'llama3' only); use one of them or no rope scaling"
        )
    return c.number("rope_theta", theta), scaling


def _check_computation(c: _Config, layers: int) -> None:
    """Refuse keys that change what the model computes in a way the family does not model."""
    fam, mt = c.fam, c.fam.model_type
    key = fam.act_key
    act = c.cfg.get(key)
    if act is not None and act != fam.hidden_act:
        raise UnsupportedConfigError(
            f"{mt} config has {key}={act!r}; the {mt} family models a gated MLP with "
            f"{key}={fam.hidden_act!r} only (the engines and the Megatron builder apply "
            f"{fam.hidden_act}), so this model would compute differently; use a config with "
            f"{key}={fam.hidden_act!r} or add the activation to the family"
        )
    if not fam.partial_rotary:
        _check_full_rotary(c, "partial_rotary_factor", c.cfg.get("partial_rotary_factor"))
    for key, want in fam.must_be:
        have = c.cfg.get(key)
        if have is not None and have != want:
            raise UnsupportedConfigError(
                f"{mt} config has {key}={have!r}; the {mt} family models {key}={want!r} only "
                f"(the engines and the Megatron builder compute it so), so this model would "
                f"compute differently; set {key} to {want!r}"
            )
    _check_sliding_window(c, layers)


def _check_full_rotary(c: _Config, where: str, value: object) -> None:
    if value is not None and value != 1:
        mt = c.fam.model_type
        raise UnsupportedConfigError(
            f"{mt} config has {where}={value!r}: rotary embeddings on part of each head; the "
            f"{mt} family rotates all head_dim dims (so do the engines and the Megatron "
            f"builder); use a config without partial_rotary_factor (or 1.0)"
        )


def _check_sliding_window(c: _Config, layers: int) -> None:
    fam, mt = c.fam, c.fam.model_type
    # a DSA family's layer kinds are read by model.dsa.dsa_fields
    kinds = None if fam.indexer else c.cfg.get("layer_types")
    if kinds is not None:
        if isinstance(kinds, str) or not isinstance(kinds, Sequence):
            raise SpecError(
                f"layer_types={kinds!r} must be a list of attention kinds, one per layer"
            )
        if len(kinds) != layers:
            raise SpecError(
                f"layer_types has {len(kinds)} entries but num_hidden_layers={layers}; give one "
                f"attention kind per layer"
            )
        if fam.linear_attention:
            check_layer_kinds(fam, kinds)
        absent = fam.sliding_window == "absent"
        allowed = ("full_attention",) if absent else ("full_attention", "sliding_attention")
        for i, kind in enumerate(kinds):
            if kind not in allowed and not fam.linear_attention:
                modelled = (
                    ""
                    if absent
                    else " (and 'sliding_attention' ones while use_sliding_window is false)"
                )
                raise UnsupportedConfigError(
                    f"{mt} config has layer_types[{i}]={kind!r}; the {mt} family models "
                    f"'full_attention' layers{modelled} only; use a model whose layers are all "
                    f"'full_attention'"
                )
    if fam.sliding_window == "layer_types":
        return  # modelled: read by layer_types.sliding_fields
    has_key = "sliding_window" in c.cfg
    window = c.cfg["sliding_window"] if has_key else None
    if fam.sliding_window == "when_set":
        window = window if has_key else fam.default("sliding_window")
        if window is not None:
            raise UnsupportedConfigError(
                f"{mt} config has sliding_window={window!r}"
                f"{'' if has_key else ' (the config-class default)'}: every {mt} layer then "
                f"attends to a window of {window} tokens, but the family models full causal "
                f"attention only; set sliding_window to null (as Mistral-7B-v0.3 and Mixtral "
                f"configs do) or use a model without a sliding window"
            )
        return
    if fam.sliding_window == "absent":
        if window is not None:
            raise UnsupportedConfigError(
                f"{mt} config has sliding_window={window!r}, but the {mt} family has no "
                f"sliding-window attention (transformers ignores the key for {mt}, so every "
                f"layer would attend to the whole context); set sliding_window to null, or use "
                f"a model without a sliding window (Mistral-style configs are not supported)"
            )
        return
    if not c.flag("use_sliding_window"):
        return
    if not has_key:
        window = fam.default("sliding_window")
    if window is None:
        return
    if fam.sliding_window == "all_layers":
        sliding, why = list(range(layers)), "every layer"
    elif kinds is not None:
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        why = "the layers layer_types marks 'sliding_attention'"
    else:
        first = c.integer("max_window_layers", minimum=0)
        sliding = list(range(first, layers))
        why = f"layers with index >= max_window_layers={first}"
    if sliding:
        raise UnsupportedConfigError(
            f"{mt} config turns on sliding-window attention (use_sliding_window=true, "
            f"sliding_window={window!r}) for {len(sliding)} of {layers} layers {sliding[:8]} "
            f"({why}); the {mt} family models full causal attention only, so those layers "
            f"would attend to the whole context; set use_sliding_window to false (as Qwen2.5 "
            f"configs do) or use a model without sliding-window layers"
        )


def _local_theta(c: _Config, nested: object) -> float:
    """The sliding layers' rope base: ``rope_local_base_freq``, or the sliding entry of
    nested ``rope_parameters`` (both given: they must agree)."""
    top = c.cfg.get("rope_local_base_freq")
    if top is not None and nested is not None and top != nested:
        raise SpecError(
            f"config sets rope_local_base_freq={top!r} and rope_parameters.sliding_attention."
            f"rope_theta={nested!r}; they must agree"
        )
    value = nested if nested is not None else c.get("rope_local_base_freq")
    return c.number("rope_local_base_freq", value)


def _layer_kinds(c: _Config, layers: int) -> dict[str, object]:
    """The per-layer kinds the family models: sliding windows, linear attention."""
    out: dict[str, object] = {}
    if c.fam.sliding_window == "layer_types":
        out.update(sliding_fields(c.cfg, c.fam, layers, c.integer))
    if c.fam.linear_attention:
        out.update(linear_fields(c.cfg, c.fam, layers, c.integer))
    return out


def _clamped_swiglu(c: _Config) -> dict[str, object]:
    return {k: c.number(k, c.get(k)) for k in ("swiglu_alpha", "swiglu_limit")}


def _spec_fields(raw: Mapping[str, object], *, mtp: bool = False) -> dict[str, object]:
    """The :class:`~areal_fn.model.spec.ModelSpec` fields of one config dict (``mtp``:
    with the multi-token-prediction layers the config declares)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise SpecError(
            f"config has model_type={model_type!r}; an HF config.json names its model_type, "
            f"one of {sorted(FAMILIES)}"
        )
    raw, model_type = _resolve_alias(raw, model_type)
    fam = family(model_type)
    flat, local_theta = split_layer_rope(raw, fam)
    c = _Config(flat, fam)
    hidden = c.integer("hidden_size")
    heads = c.integer("num_attention_heads")
    layers = c.integer("num_hidden_layers")
    _check_computation(c, layers)
    kv = c.get("num_key_value_heads")
    kv_heads = heads if kv is None else c.integer("num_key_value_heads")
    if fam.mla:
        head_dim = 0  # from mla_fields below
    elif c.get("head_dim") is None:
        if hidden % heads:
            raise SpecError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and the "
                f"config has no head_dim; give head_dim explicitly or make hidden_size a "
                f"multiple of num_attention_heads"
            )
        head_dim = hidden // heads
    else:
        head_dim = c.integer("head_dim")
    fields: dict[str, object] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": c.integer("intermediate_size"),
        "vocab_size": c.integer("vocab_size"),
        "max_position_embeddings": c.integer("max_position_embeddings"),
        "tie_word_embeddings": c.flag("tie_word_embeddings"),
        "rms_norm_eps": c.number("rms_norm_eps", c.get("rms_norm_eps")),
        "dtype": _dtype(c.cfg.get("torch_dtype")),
    }
    fields["rope_theta"], fields["rope_scaling"] = _rope(c)
    fields.update(fam.fixed)
    for key, targets in fam.bias_flags:
        flag = c.flag(key)
        fields.update(dict.fromkeys(targets, flag))
    if fam.partial_rotary:
        fields["rotary_fraction"] = _rotary_fraction(c)
    if fam.mla:
        fields.update(mla_fields(c.cfg, c.get, c.integer, model_type))
    fields.update(_layer_kinds(c, layers))
    if fam.has_default("rope_local_base_freq"):
        fields["rope_local_theta"] = _local_theta(c, local_theta)
    if fam.attn_scalar:
        fields["query_pre_attn_scalar"] = c.integer("query_pre_attn_scalar")
    if fam.clamped_swiglu:
        fields.update(_clamped_swiglu(c))
    if fam.moe:
        fields.update(_routing(c))
        fields.update(
            num_experts=c.integer("num_experts"),
            num_experts_per_tok=c.integer("num_experts_per_tok"),
            moe_intermediate_size=c.integer("moe_intermediate_size"),
            norm_topk_prob=fields.get("norm_topk_prob", None)  # fixed by the family
            if "norm_topk_prob" in fields
            else c.flag("norm_topk_prob"),
            moe_layers=_first_k_dense(c, layers) if fam.first_k_dense else _moe_layers(c, layers),
        )
    else:
        fields["moe_layers"] = (False,) * layers
    if mtp and fam.mtp:
        fields["mtp_layers"] = c.integer(MTP_KEY, minimum=0)
    return fields


def _resolve_alias(raw: Mapping[str, object], model_type: str) -> tuple[Mapping[str, object], str]:
    """The config and family of an aliased ``model_type`` (:data:`MODEL_TYPE_ALIASES`),
    which the config's ``architectures`` must name, or of a multimodal one whose text
    model is read (:func:`~areal_fn.model.linear_attention.text_config`); without the
    family's ``ignored_rope_keys``."""
    raw, model_type = text_config(raw, model_type)
    target = dict(MODEL_TYPE_ALIASES).get(model_type)
    if target is None:
        return without_rope_keys(raw, family(model_type)), model_type
    arch = FAMILIES[target].architecture
    if raw.get("architectures") != [arch]:
        raise SpecError(
            f"config has model_type={model_type!r}, read as {target!r} when its architectures "
            f"is [{arch!r}], but it is {raw.get('architectures')!r}; set architectures to "
            f"[{arch!r}] or model_type to a supported one"
        )
    return raw, target


def _dtype(value: object) -> str:
    if value is None:
        return "bfloat16"
    if not isinstance(value, str):
        raise SpecError(f"torch_dtype={value!r} must be a dtype name such as 'bfloat16'")
    try:
        return dtype_name(value)
    except SpecError as exc:
        raise SpecError(f"torch_dtype: {exc}") from None


def _rotary_fraction(c: _Config) -> float:
    """``partial_rotary_factor`` from the top level or ``rope_parameters`` (they must agree)."""
    params = c.cfg.get("rope_parameters")
    inner = params.get("partial_rotary_factor") if isinstance(params, Mapping) else None
    top = c.cfg.get("partial_rotary_factor")
    if top is not None and inner is not None and top != inner:
        raise SpecError(
            f"config sets partial_rotary_factor={top!r} and rope_parameters."
            f"partial_rotary_factor={inner!r}; they must agree"
        )
    value = top if top is not None else inner
    dim_key = c.fam.rotary_dim_key
    if dim_key is not None and c.cfg.get(dim_key) is not None:
        dims, head_dim = c.integer(dim_key), c.integer("head_dim")
        if dims > head_dim or dims % 2:
            raise SpecError(
                f"{dim_key}={dims} must be an even number of dims at most head_dim={head_dim}"
            )
        if value is not None and value != dims / head_dim:
            raise SpecError(
                f"config sets {dim_key}={dims} (a factor of {dims / head_dim} of head_dim="
                f"{head_dim}) and partial_rotary_factor={value!r}; they must agree"
            )
        value = dims / head_dim
    return c.number(
        "partial_rotary_factor", value if value is not None else c.get("partial_rotary_factor")
    )


def _routing(c: _Config) -> dict[str, object]:
    """The routing fields the family's config gives (``moe_keys``)."""
    out: dict[str, object] = {}
    for field, key in c.fam.moe_keys:
        if field == "routed_scaling_factor":
            out[field] = c.number(key, c.get(key))
        else:
            # transformers builds zero-width shared experts for n_shared_experts=0
            out[field] = c.integer(key)
    return out


def _first_k_dense(c: _Config, layers: int) -> tuple[bool, ...]:
    key = c.fam.first_k_dense
    assert key is not None  # called for families that name it
    k = c.integer(key, minimum=0)
    if k > layers:
        raise SpecError(
            f"{key}={k} exceeds num_hidden_layers={layers}; at most every layer is dense"
        )
    return tuple(i >= k for i in range(layers))


def _moe_layers(c: _Config, layers: int) -> tuple[bool, ...]:
    step = c.integer("decoder_sparse_step")
    only = c.get("mlp_only_layers")
    if isinstance(only, str) or not isinstance(only, Sequence):
        raise SpecError(f"mlp_only_layers={only!r} must be a list of layer indices")
    for i in only:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers:
            raise SpecError(
                f"mlp_only_layers={list(only)!r} contains {i!r}, outside range(0, {layers}) "
                f"(num_hidden_layers={layers}); list only existing layer indices"
            )
    dense = set(only)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
