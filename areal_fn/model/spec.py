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
"""

import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from areal_fn.errors import SpecError, UnsupportedConfigError
from areal_fn.model.families import FAMILIES, Family, family
from areal_fn.model.tensor_spec import TensorSpec, dtype_name
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


def _bools(value: object) -> tuple[bool, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise SpecError(f"ModelSpec.moe_layers={value!r} must be a sequence of bools")
    out = tuple(value)
    for v in out:
        if not isinstance(v, bool):
            raise SpecError(f"ModelSpec.moe_layers has {v!r}; every entry must be a bool")
    return out


def _check_model(spec: "ModelSpec") -> None:
    fam = spec.family
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    if heads % kv:
        raise SpecError(
            f"num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
            f"grouped-query attention needs num_attention_heads % num_key_value_heads == 0"
        )
    if spec.head_dim % 2:
        raise SpecError(
            f"head_dim={spec.head_dim} is odd; rotary embeddings rotate pairs of dims, "
            f"so head_dim must be even"
        )
    if fam.hidden_divisible_by_heads and spec.hidden_size % heads:
        raise SpecError(
            f"hidden_size={spec.hidden_size} is not divisible by num_attention_heads={heads}; "
            f"{fam.model_type} requires it (transformers rejects such a config) even with an "
            f"explicit head_dim"
        )
    for name, value in fam.fixed:
        if getattr(spec, name) != value:
            raise SpecError(
                f"{fam.model_type} has {name}={value!r} by construction, got {name}="
                f"{getattr(spec, name)!r}; use a family whose config can express it"
            )
    for key, fields in fam.bias_flags:
        values = {f: getattr(spec, f) for f in fields}
        if len(set(values.values())) > 1:
            raise SpecError(
                f"{fam.model_type} sets {' and '.join(fields)} together from config key "
                f"{key!r}, got {values}; make them equal"
            )
    if len(spec.moe_layers) != spec.num_layers:
        raise SpecError(
            f"moe_layers has {len(spec.moe_layers)} entries but num_layers={spec.num_layers}; "
            f"give one bool per layer"
        )
    moe = (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size)
    if not fam.moe:
        if any(moe) or spec.norm_topk_prob or any(spec.moe_layers):
            raise SpecError(
                f"{fam.model_type} is a dense family but num_experts, num_experts_per_tok, "
                f"moe_intermediate_size = {moe}, norm_topk_prob={spec.norm_topk_prob}, "
                f"moe_layers has {sum(spec.moe_layers)} MoE layer(s); use zeros/False or an "
                f"MoE family such as qwen3_moe"
            )
        return
    if spec.num_experts < 1 or spec.moe_intermediate_size < 1:
        raise SpecError(
            f"{fam.model_type} needs num_experts >= 1 and moe_intermediate_size >= 1, got "
            f"num_experts={spec.num_experts}, moe_intermediate_size={spec.moe_intermediate_size}"
        )
    if not 1 <= spec.num_experts_per_tok <= spec.num_experts:
        raise SpecError(
            f"num_experts_per_tok={spec.num_experts_per_tok} must be in 1..num_experts="
            f"{spec.num_experts}; a token cannot be routed to more experts than exist"
        )


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
    ``dtype`` is the config's ``torch_dtype`` (``bfloat16`` when absent).
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
    moe_layers: tuple[bool, ...] = attrs.field(converter=_bools)
    dtype: str = attrs.field(default="bfloat16", converter=dtype_name)

    def __attrs_post_init__(self) -> None:
        _check_model(self)

    # -- derived ----------------------------------------------------------------------
    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @functools.cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Canonical checkpoint tensors, in state-dict order."""
        return tuple(
            TensorSpec(name=name, shape=shape, dtype=self.dtype)
            for name, shape in _canonical_shapes(self)
        )

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def num_params(self) -> int:
        """Parameters counted once (tied embeddings once), = sum of canonical numels."""
        return sum(t.numel for t in self.tensors)

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

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
            if i is not None:
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
            or None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        for key, fields in fam.bias_flags:
            cfg[key] = getattr(self, fields[0])
        if fam.moe:
            cfg["num_experts"] = self.num_experts
            cfg["num_experts_per_tok"] = self.num_experts_per_tok
            cfg["moe_intermediate_size"] = self.moe_intermediate_size
            cfg["decoder_sparse_step"] = 1
            cfg["mlp_only_layers"] = [i for i, m in enumerate(self.moe_layers) if not m]
            cfg["norm_topk_prob"] = self.norm_topk_prob
        return dict(sorted(cfg.items()))


# -- canonical tensors ----------------------------------------------------------------


def _canonical_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    hid, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab_size, hid))]

    def linear(name: str, n_out: int, n_in: int, bias: bool) -> None:
        out.append((f"{name}.weight", (n_out, n_in)))
        if bias:
            out.append((f"{name}.bias", (n_out,)))

    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        linear(p + "self_attn.q_proj", q_out, hid, spec.qkv_bias)
        linear(p + "self_attn.k_proj", kv_out, hid, spec.qkv_bias)
        linear(p + "self_attn.v_proj", kv_out, hid, spec.qkv_bias)
        linear(p + "self_attn.o_proj", hid, q_out, spec.o_bias)
        if spec.qk_norm:
            out.append((p + "self_attn.q_norm.weight", (hd,)))
            out.append((p + "self_attn.k_norm.weight", (hd,)))
        if spec.moe_layers[i]:
            inter = spec.moe_intermediate_size
            for e in range(spec.num_experts):
                out.append((f"{p}mlp.experts.{e}.gate_proj.weight", (inter, hid)))
                out.append((f"{p}mlp.experts.{e}.up_proj.weight", (inter, hid)))
                out.append((f"{p}mlp.experts.{e}.down_proj.weight", (hid, inter)))
            out.append((p + "mlp.gate.weight", (spec.num_experts, hid)))
        else:
            inter = spec.intermediate_size
            linear(p + "mlp.gate_proj", inter, hid, spec.mlp_bias)
            linear(p + "mlp.up_proj", inter, hid, spec.mlp_bias)
            linear(p + "mlp.down_proj", hid, inter, spec.mlp_bias)
        out.append((p + "input_layernorm.weight", (hid,)))
        out.append((p + "post_attention_layernorm.weight", (hid,)))
    out.append(("model.norm.weight", (hid,)))
    if not spec.tie_word_embeddings:
        out.append(("lm_head.weight", (spec.vocab_size, hid)))
    return out


# -- config.json -> ModelSpec ---------------------------------------------------------

#: Rope types (``rope_scaling`` / ``rope_parameters`` ``rope_type``) with an implementation
#: in transformers, which the FSDP2 engine builds from ``hf_config()``; the Megatron builder
#: applies ``llama3`` only (:func:`areal_fn.runtime.megatron.build.rope_kwargs`).
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")

#: Other names a config may use for a key (transformers 5 writes the second form).
_ALIASES = (("num_experts", "num_local_experts"), ("torch_dtype", "dtype"))

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@beartype
def load_hf_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a ``config.json`` (or the ``config.json`` inside a directory) into a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise SpecError(
            f"no config file at {str(p)!r}; pass a config.json path, a directory holding "
            f"config.json, or the config as a dict"
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{str(p)!r} is not valid JSON ({exc}); pass an HF config.json") from None
    if not isinstance(data, dict):
        raise SpecError(f"{str(p)!r} holds a JSON {type(data).__name__}, not an object")
    return data


@beartype
def model_from_hf_config(config: str | os.PathLike[str] | Mapping[str, object]) -> ModelSpec:
    """The :class:`ModelSpec` of an HF ``config.json`` (a dict, a file, or a directory).

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
        return _from_mapping(config)
    source = str(config)
    data = load_hf_config(config)
    try:
        return _from_mapping(data)
    except SpecError as exc:
        raise type(exc)(f"{source}: {exc}") from None


class _Config:
    """Typed reads of one family's config dict (defaults, aliases, error wording)."""

    def __init__(self, raw: Mapping[str, object], fam: Family) -> None:
        cfg = dict(raw)
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
    scaling = _rope_pairs(legacy if legacy else params)
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
    act = c.cfg.get("hidden_act")
    if act is not None and act != fam.hidden_act:
        raise UnsupportedConfigError(
            f"{mt} config has hidden_act={act!r}; the {mt} family models a SwiGLU MLP with "
            f"hidden_act={fam.hidden_act!r} only (the engines and the Megatron builder apply "
            f"{fam.hidden_act}), so this model would compute differently; use a config with "
            f"hidden_act={fam.hidden_act!r} or add the activation to the family"
        )
    _check_full_rotary(c, "partial_rotary_factor", c.cfg.get("partial_rotary_factor"))
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
    kinds = c.cfg.get("layer_types")
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
        absent = fam.sliding_window == "absent"
        allowed = ("full_attention",) if absent else ("full_attention", "sliding_attention")
        for i, kind in enumerate(kinds):
            if kind not in allowed:
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
    has_key = "sliding_window" in c.cfg
    window = c.cfg["sliding_window"] if has_key else None
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


def _from_mapping(raw: Mapping[str, object]) -> ModelSpec:
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise SpecError(
            f"config has model_type={model_type!r}; an HF config.json names its model_type, "
            f"one of {sorted(FAMILIES)}"
        )
    fam = family(model_type)
    c = _Config(raw, fam)
    hidden = c.integer("hidden_size")
    heads = c.integer("num_attention_heads")
    layers = c.integer("num_hidden_layers")
    _check_computation(c, layers)
    kv = c.get("num_key_value_heads")
    kv_heads = heads if kv is None else c.integer("num_key_value_heads")
    if c.get("head_dim") is None:
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
    if fam.moe:
        fields.update(
            num_experts=c.integer("num_experts"),
            num_experts_per_tok=c.integer("num_experts_per_tok"),
            moe_intermediate_size=c.integer("moe_intermediate_size"),
            norm_topk_prob=c.flag("norm_topk_prob"),
            moe_layers=_moe_layers(c, layers),
        )
    else:
        fields["moe_layers"] = (False,) * layers
    return ModelSpec(**fields)  # type: ignore[arg-type]


def _dtype(value: object) -> str:
    if value is None:
        return "bfloat16"
    if not isinstance(value, str):
        raise SpecError(f"torch_dtype={value!r} must be a dtype name such as 'bfloat16'")
    try:
        return dtype_name(value)
    except SpecError as exc:
        raise SpecError(f"torch_dtype: {exc}") from None


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


@beartype
def layer_of(name: str) -> int | None:
    """The decoder layer index of a canonical tensor name, None for non-layer tensors."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None
