"""Gated-delta-net linear attention (Qwen3-Next, Qwen3.5): its sizes, which layers have
it, and what a config says of it.

A family with ``linear_attention`` (:attr:`~areal_fn.model.families.Family.linear_attention`)
mixes two kinds of layer, as its config's ``layer_types`` says (default: every
``full_attention_interval``-th layer, 4, is ``full_attention``, the others
``linear_attention``). A full-attention layer is grouped-query attention whose ``q_proj``
also gives a sigmoid gate on its output (``[q_h; gate_h]`` per head). A linear-attention
layer (``linear_attn``) projects the hidden state into queries and keys
(``key_heads`` heads of ``key_head_dim``), values and an output gate ``z``
(``value_heads`` heads of ``value_head_dim``) and two per-value-head scalars ``b``
(the write strength) and ``a`` (the decay, with ``A_log`` and ``dt_bias``); a depthwise
causal ``conv1d`` of ``conv_kernel`` taps runs over ``[q; k; v]``; a gated RMSNorm
``norm`` of ``value_head_dim`` and ``out_proj`` close it. Its state is one
``key_head_dim x value_head_dim`` matrix per value head, whatever the context length.

:class:`LinearAttention` is the record :class:`~areal_fn.model.spec.ModelSpec` holds;
:func:`linear_fields` reads it from a config, :func:`linear_config` writes it back.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from areal_fn.errors import LayoutError, SpecError, UnsupportedConfigError
from areal_fn.model.families import TEXT_CONFIG_TYPES, Family
from areal_fn.model.families.mapping import Dim
from areal_fn.model.families.mixer import Mixer

#: The ``layer_types`` entries of a family with linear attention.
LINEAR_KINDS = ("full_attention", "linear_attention")


def _positive(_inst: object, attr: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"LinearAttention.{attr.name}={value!r} must be an int >= 1")


def _bools(value: object) -> tuple[bool, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise SpecError(f"LinearAttention.layers={value!r} must be a sequence of bools")
    out = tuple(value)
    if not all(isinstance(v, bool) for v in out):
        raise SpecError(f"LinearAttention.layers={out!r}: every entry must be a bool")
    return out


def _check(inst: "LinearAttention") -> None:
    if inst.value_heads % inst.key_heads:
        raise SpecError(
            f"LinearAttention: value_heads={inst.value_heads} is not a multiple of "
            f"key_heads={inst.key_heads}; each key head serves value_heads // key_heads value "
            "heads (linear_num_value_heads must be a multiple of linear_num_key_heads)"
        )


@attrs.frozen(kw_only=True)
class LinearAttention:
    """A model's gated-delta-net layers: ``layers[i]`` is True when layer ``i`` is linear
    attention; the head counts and sizes of every such layer; the conv's taps."""

    key_heads: int = attrs.field(validator=_positive)
    value_heads: int = attrs.field(validator=_positive)
    key_head_dim: int = attrs.field(validator=_positive)
    value_head_dim: int = attrs.field(validator=_positive)
    conv_kernel: int = attrs.field(validator=_positive)
    layers: tuple[bool, ...] = attrs.field(converter=_bools)

    def __attrs_post_init__(self) -> None:
        _check(self)

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def state_numel(self) -> int:
        """Elements of one layer's recurrent state per sequence (every value head's
        ``key_head_dim x value_head_dim`` matrix) plus its conv window
        (``conv_kernel - 1`` past inputs of ``2 * key_dim + value_dim`` channels)."""
        conv = (self.conv_kernel - 1) * (2 * self.key_dim + self.value_dim)
        return self.value_heads * self.key_head_dim * self.value_head_dim + conv


def check(_inst: object, _attr: object, value: "LinearAttention | None") -> None:
    """``ModelSpec.linear_attention`` is a :class:`LinearAttention` or ``None``."""
    if value is not None and not isinstance(value, LinearAttention):
        raise SpecError(f"ModelSpec.linear_attention={value!r} must be a LinearAttention or None")


def linear_sizes(spec: Any) -> dict[Dim, int]:
    """The size of the gated-attention, gated-shared-expert and linear-attention
    :class:`Dim` values of ``spec`` (linear ones 0 without linear attention)."""
    la: LinearAttention | None = spec.linear_attention
    out = {
        Dim.GATED_Q_OUT: 2 * spec.num_attention_heads * spec.head_dim,
        Dim.SHARED_EXPERT: spec.shared_expert_size,
        Dim.ONE: 1,
    }
    if la is None:
        zero = (Dim.LIN_QKVZ, Dim.LIN_QKV, Dim.LIN_V, Dim.LIN_V_HEADS, Dim.LIN_BA)
        return out | dict.fromkeys((*zero, Dim.LIN_V_HEAD_DIM, Dim.LIN_CONV), 0)
    return out | {
        Dim.LIN_QKVZ: 2 * la.key_dim + 2 * la.value_dim,
        Dim.LIN_QKV: 2 * la.key_dim + la.value_dim,
        Dim.LIN_V: la.value_dim,
        Dim.LIN_V_HEADS: la.value_heads,
        Dim.LIN_BA: 2 * la.value_heads,
        Dim.LIN_V_HEAD_DIM: la.value_head_dim,
        Dim.LIN_CONV: la.conv_kernel,
    }


def is_linear_layer(spec: Any, layer: int) -> bool:
    """Layer ``layer`` of ``spec`` is gated-delta-net linear attention."""
    la = spec.linear_attention
    return la is not None and layer < len(la.layers) and la.layers[layer]


def linear_fields(
    cfg: Mapping[str, object], fam: Family, layers: int, integer: Callable[[str], int]
) -> dict[str, object]:
    """``linear_attention`` (and ``shared_expert_size`` for an MoE family) of a config.

    ``integer`` reads a config key (with the family's default) as a positive int.
    """
    kinds = cfg.get("layer_types")
    if kinds is None:
        every = integer("full_attention_interval")
        kinds = [LINEAR_KINDS[(i + 1) % every != 0] for i in range(layers)]
    elif "full_attention_interval" in cfg:
        want = [
            LINEAR_KINDS[(i + 1) % integer("full_attention_interval") != 0] for i in range(layers)
        ]
        if list(kinds) != want:  # type: ignore[call-overload]
            raise SpecError(
                f"{fam.model_type} config gives layer_types and full_attention_interval="
                f"{cfg['full_attention_interval']!r}, which disagree; transformers reads "
                "layer_types and drops the interval; give one of them"
            )
    out: dict[str, object] = {
        "linear_attention": LinearAttention(
            key_heads=integer("linear_num_key_heads"),
            value_heads=integer("linear_num_value_heads"),
            key_head_dim=integer("linear_key_head_dim"),
            value_head_dim=integer("linear_value_head_dim"),
            conv_kernel=integer("linear_conv_kernel_dim"),
            layers=tuple(k == "linear_attention" for k in kinds),  # type: ignore[attr-defined]
        )
    }
    if fam.moe:
        out["shared_expert_size"] = integer("shared_expert_intermediate_size")
    return out


def check_layer_kinds(fam: Family, kinds: Sequence[object]) -> None:
    """Every ``layer_types`` entry of a linear-attention family is one of :data:`LINEAR_KINDS`."""
    for i, kind in enumerate(kinds):
        if kind not in LINEAR_KINDS:
            raise UnsupportedConfigError(
                f"{fam.model_type} config has layer_types[{i}]={kind!r}; the "
                f"{fam.model_type} family models {list(LINEAR_KINDS)} layers only"
            )


def linear_config(spec: Any, cfg: dict[str, object]) -> dict[str, object]:
    """``cfg`` (a spec's ``hf_config()`` so far) with the linear-attention keys, the
    gated shared expert's width, and without the keys the family's config class lacks."""
    la: LinearAttention | None = spec.linear_attention
    out = {k: v for k, v in cfg.items() if k not in dict(spec.family.foreign_keys)}
    if la is None:
        return out
    out.update(
        linear_num_key_heads=la.key_heads,
        linear_num_value_heads=la.value_heads,
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_conv_kernel_dim=la.conv_kernel,
        layer_types=[LINEAR_KINDS[x] for x in la.layers],
    )
    if spec.family.moe:
        out["shared_expert_intermediate_size"] = spec.shared_expert_size
    return out


def text_config(raw: Mapping[str, object], model_type: str) -> tuple[Mapping[str, object], str]:
    """The text model's config of a multimodal config (:data:`TEXT_CONFIG_TYPES`), with its
    ``model_type``; any other config unchanged. The text model's ``tie_word_embeddings``
    is the top level's when the nested config gives none (they must agree otherwise)."""
    want = {t.model_type: t.text_model_type for t in TEXT_CONFIG_TYPES}.get(model_type)
    if want is None:
        return raw, model_type
    text = raw.get("text_config")
    if not isinstance(text, Mapping) or text.get("model_type", want) != want:
        raise SpecError(
            f"config has model_type={model_type!r}, a multimodal model whose text model is "
            f"read from text_config (model_type {want!r}), but text_config is {text!r}; pass "
            f"the published config.json, or a {want!r} config of the text model"
        )
    out = {**text, "model_type": want}
    tie, inner = raw.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if tie is not None and inner is not None and tie != inner:
        raise SpecError(
            f"config sets tie_word_embeddings={tie!r} and text_config.tie_word_embeddings="
            f"{inner!r}; they must agree"
        )
    if inner is None and tie is not None:
        out["tie_word_embeddings"] = tie
    if "torch_dtype" not in out and "dtype" not in out:
        dtype = raw.get("torch_dtype", raw.get("dtype"))
        if dtype is not None:
            out["torch_dtype"] = dtype
    return out, want


def without_rope_keys(raw: Mapping[str, object], fam: Family) -> Mapping[str, object]:
    """``raw`` without the family's :attr:`~areal_fn.model.families.Family.ignored_rope_keys`
    in ``rope_parameters`` and ``rope_scaling``."""
    if not fam.ignored_rope_keys:
        return raw
    out = dict(raw)
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if isinstance(value, Mapping):
            out[key] = {k: v for k, v in value.items() if k not in fam.ignored_rope_keys}
    return out


def check_linear(spec: Any) -> None:
    """A linear-attention family's spec has :class:`LinearAttention` with one kind per
    layer (and an MoE one its shared expert's width); other families have neither."""
    fam, la, n = spec.family, spec.linear_attention, spec.num_layers
    if not fam.linear_attention:
        if la is not None or spec.shared_expert_size:
            raise SpecError(
                f"ModelSpec.linear_attention={la!r}, shared_expert_size="
                f"{spec.shared_expert_size}: the {fam.model_type} family has no linear "
                "attention and no gated shared expert (use None and 0)"
            )
        return
    if la is None or len(la.layers) != n:
        raise SpecError(
            f"ModelSpec.linear_attention={la!r}: {fam.model_type} needs a LinearAttention "
            f"with one bool per layer (num_layers={n})"
        )
    if fam.moe and spec.shared_expert_size < 1:
        raise SpecError(
            f"ModelSpec.shared_expert_size={spec.shared_expert_size}: {fam.model_type}'s MoE "
            "layers have a gated shared expert of shared_expert_intermediate_size >= 1"
        )


def check_packing(spec: Any) -> None:
    """Refuse packed rows (several sequences in one row) for a family whose layers carry
    a state along the sequence (:attr:`~areal_fn.model.families.Family.sequence_refusal`),
    unless that state is linear attention's: the FSDP2 engine runs each linear-attention
    layer on every sequence of a packed row alone
    (:mod:`~areal_fn.runtime.engines.linear_packed`), so its state and conv window
    start afresh at each sequence."""
    why = spec.family.sequence_refusal
    if why and not spec.family.linear_attention:
        raise LayoutError(f"packed sequences are refused: {why}")


def linear_mixers(spec: Any) -> tuple[tuple[str, str], ...]:
    """``(decoder layer, its linear-attention module)`` module names of every
    linear-attention layer of ``spec``, in layer order (the module: the common prefix of
    the family's linear-attention tensors, e.g. ``model.layers.0`` and
    ``model.layers.0.linear_attn``); empty without linear attention."""
    la: LinearAttention | None = spec.linear_attention
    rows = [r.name for r in spec.family.canonical if r.mixer is Mixer.LINEAR]
    if la is None or not rows:
        return ()
    parts = [name.split(".") for name in rows]
    common = []
    for column in zip(*parts, strict=False):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    module = ".".join(common)
    out = []
    for i, linear in enumerate(la.layers):
        if linear:
            full = next(t.name for t in spec.layer_tensors(i) if t.name.endswith("." + rows[0]))
            layer = full.removesuffix("." + rows[0])
            out.append((layer, f"{layer}.{module}"))
    return tuple(out)
