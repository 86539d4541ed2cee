"""Model families: one small data module per Hugging Face ``model_type``.

A family is a :class:`Family` record, not a subclass: it says which ``config.json`` keys
are required, which optional keys default to what (the transformers 5 defaults), which
bias flags the config controls, which architecture fields the family fixes, and, for
MoE families, how transformers fuses per-expert checkpoint tensors in memory.
:func:`areal_fn.model.spec.model_from_hf_config` interprets these records; nothing here
reads files or imports torch.

Supported ``model_type``: see :data:`FAMILIES`.
"""

from collections.abc import Iterable
from typing import Literal

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.families.mapping import HfTensor, LayerKind, MegatronTensor
from areal_fn.model.families.mixer import Mixer
from areal_fn.model.families.serving import MtpBlock, OuterTensors, Serving
from areal_fn.typecheck import beartype

#: How a config class switches sliding-window attention on (see :class:`Family`).
SlidingWindow = Literal["absent", "max_window_layers", "all_layers", "when_set", "layer_types"]


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _pairs(value: object) -> tuple[tuple[str, object], ...]:
    return tuple((str(k), v) for k, v in value)  # type: ignore[attr-defined]


@attrs.frozen(kw_only=True)
class FusedExperts:
    """One in-memory tensor that stacks per-expert checkpoint tensors.

    In memory (transformers 5) the tensor ``model.layers.{i}.{name}`` has shape
    ``[num_experts, *fused_shape]``; expert ``e``'s slice concatenates the checkpoint
    tensors ``model.layers.{i}.{part.format(e=e)}`` along ``concat_dim`` (a dim of the
    per-expert tensor), in the order of ``parts``.
    """

    name: str
    parts: tuple[str, ...] = attrs.field(converter=_strs)
    concat_dim: int = 0


#: The config keys every family requires (Llama-style classes require only these).
CORE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


#: Routed SwiGLU experts ``mlp.experts.{e}.{gate,up,down}_proj`` as transformers 5
#: stacks them in memory (Qwen3-MoE, GLM-4.5): ``gate_up_proj`` ``[E, 2*I, H]``,
#: ``down_proj`` ``[E, H, I]``.
STACKED_SWIGLU_EXPERTS = (
    FusedExperts(
        name="mlp.experts.gate_up_proj",
        parts=("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        concat_dim=0,
    ),
    FusedExperts(
        name="mlp.experts.down_proj",
        parts=("mlp.experts.{e}.down_proj.weight",),
        concat_dim=0,
    ),
)


#: The routing fields a plain softmax top-k router fixes (no shared experts, no bias,
#: no groups, no scaling): Qwen3-MoE and Mixtral.
SOFTMAX_ROUTING: tuple[tuple[str, object], ...] = (
    ("num_shared_experts", 0),
    ("router_score", "softmax"),
    ("router_bias", False),
    ("router_groups", 1),
    ("router_group_topk", 1),
    ("routed_scaling_factor", 1.0),
)


def _fused_tuple(value: Iterable[FusedExperts]) -> tuple[FusedExperts, ...]:
    return tuple(value)


def _canonical_tuple(value: Iterable[HfTensor]) -> tuple[HfTensor, ...]:
    return tuple(value)


def _check_unique(family: str, table: tuple[HfTensor | MegatronTensor, ...], what: str) -> None:
    """No name twice for overlapping layer kinds and mixers (``ALL``, ``ANY`` overlap both)."""
    names = [r.name if isinstance(r, HfTensor) else r.local for r in table]
    for i, rec in enumerate(table):
        for j, other in enumerate(table[:i]):
            overlap = LayerKind.ALL in (rec.layers, other.layers) or rec.layers is other.layers
            mixers = Mixer.ANY in (rec.mixer, other.mixer) or rec.mixer is other.mixer
            if names[j] == names[i] and overlap and mixers:
                raise SpecError(
                    f"family {family!r}: its {what} table lists {names[i]!r} twice "
                    f"for the same layers ({other.layers!r} and {rec.layers!r})"
                )


def _check_canonical(inst: "Family", _attr: object, table: tuple[HfTensor, ...]) -> None:
    _check_unique(inst.model_type, table, "canonical")


def _megatron_tuple(value: Iterable[MegatronTensor]) -> tuple[MegatronTensor, ...]:
    return tuple(value)


def _check_megatron(inst: "Family", _attr: object, table: tuple[MegatronTensor, ...]) -> None:
    _check_unique(inst.model_type, table, "Megatron")


@attrs.frozen(kw_only=True)
class Family:
    """How one ``model_type`` maps ``config.json`` keys to a :class:`~areal_fn.model.spec.ModelSpec`.

    - ``required``: config keys that must be present (``null`` counts as absent).
    - ``defaults``: optional config keys and the value used when absent, equal to the
      transformers 5 config-class default.
    - ``bias_flags``: config key -> ModelSpec bias fields it switches on together.
    - ``fixed``: ModelSpec fields whose value the family fixes (e.g. Qwen2 always has
      q/k/v biases and no o_proj bias).
    - ``head_dim_required``: ``head_dim`` must be given explicitly (Qwen3: transformers
      would otherwise use 128, not ``hidden_size // num_attention_heads``).
    - ``hidden_divisible_by_heads``: ``hidden_size % num_attention_heads == 0`` is checked
      even when ``head_dim`` is explicit (transformers' ``LlamaConfig`` rejects it).
    - ``moe`` and ``fused_experts``: the family has routed experts and transformers 5
      keeps them fused in memory as described.
    - ``canonical``: a decoder layer's canonical tensors, in state-dict order, and
      ``megatron``: the HF <-> Megatron-Core table of a decoder layer
      (:mod:`areal_fn.model.families.mapping`).
    - ``hidden_act``: the one MLP activation the family models (SwiGLU with ``silu``);
      a config asking for another is refused.
    - ``sliding_window``: how the config class switches sliding-window attention on,
      which the other families do not model (a config that turns it on for some layer is refused):
      ``"absent"``: the class has none, so a non-null ``sliding_window`` (which
      transformers would ignore) is refused; ``"max_window_layers"``: with
      ``use_sliding_window`` true and ``sliding_window`` not null, the layers that
      ``layer_types`` marks ``"sliding_attention"`` (default: those with index
      ``>= max_window_layers``) slide; ``"all_layers"``: with ``use_sliding_window``
      true and ``sliding_window`` not null, every layer slides; ``"when_set"``: every
      layer slides whenever ``sliding_window`` is not null (Mistral, Mixtral; there is no
      ``use_sliding_window``); ``"layer_types"``: the family models sliding windows
      (gpt-oss): the layers ``layer_types`` marks ``"sliding_attention"`` attend to the
      last ``sliding_window`` tokens (read into ``ModelSpec.sliding_window`` and
      ``sliding_layers``).
    - ``clamped_swiglu``: the experts apply gpt-oss's clamped SwiGLU
      (``swiglu_alpha``, ``swiglu_limit``, read into the spec).
    - ``key_sources``: config keys the family's config class does not have, read from
      another key (Mixtral's experts are ``intermediate_size`` wide:
      ``("moe_intermediate_size", "intermediate_size")``).
    - ``must_be``: config keys that change the computation unless they hold the given
      value (Mixtral's ``router_jitter_noise`` must be 0); another value is refused.
    - ``foreign_keys``: keys other families read that this family's config class does not
      have (transformers would ignore them), with the key to use instead; a config that
      sets one is refused rather than read differently from transformers.
    - ``partial_rotary``: the family may rotate part of each head (GLM's
      ``partial_rotary_factor``); other families refuse a factor other than 1.
      ``rotary_dim_key``: the config key that may give the rotated dims per head instead
      (MiniMax-M2's ``rotary_dim``: the factor is ``rotary_dim / head_dim``).
    - ``first_k_dense``: the config key naming how many leading layers are dense, every
      later layer MoE (DeepSeek/GLM's ``first_k_dense_replace``), or ``None`` when MoE
      layers follow ``decoder_sparse_step`` / ``mlp_only_layers``.
    - ``mtp``: the config may declare multi-token-prediction layers
      (``num_nextn_predict_layers``, :mod:`areal_fn.model.mtp`), whose own tensors the
      :class:`~areal_fn.model.families.serving.MtpBlock` names; ``None`` when it may not.
    - ``moe_keys``: ``(ModelSpec field, config key)`` of the routing fields the config
      gives (``("num_shared_experts", "n_shared_experts")``...).
    - ``mla``: multi-latent attention (DeepSeek-V3): the config gives ``q_lora_rank``,
      ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``.
    - ``indexer``: DeepSeek sparse attention (:mod:`areal_fn.model.dsa`): ``""`` none,
      ``"every_layer"`` an indexer in every layer (DeepSeek-V3.2), ``"indexer_types"``
      the config's ``indexer_types`` say which layers run their own (GLM-5).
    - ``memory_names``: canonical names (relative to the layer) that transformers 5 keeps
      under another name in memory (Mixtral's ``block_sparse_moe.gate.weight`` is
      ``mlp.gate.weight`` in ``state_dict()``).
    - ``act_key``: the config key naming the MLP activation (Gemma 3:
      ``hidden_activation``).
    - ``sliding_every``: with ``sliding_window="layer_types"`` and no ``layer_types``,
      layer ``i`` slides unless ``(i + 1) % sliding_every == 0`` (gpt-oss 2, OLMo 3 4);
      ``sliding_every_key`` the config key that sets it (Gemma 3's
      ``sliding_window_pattern``, default 6).
    - ``layer_rope``: sliding layers rotate with a base of their own
      (``rope_local_base_freq``, read into ``ModelSpec.rope_local_theta``) and rope
      scaling applies to full-attention layers only (Gemma 3; OLMo 3 shares one base);
      the config may nest ``rope_parameters`` by layer type.
    - ``attn_scalar``: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``
      (Gemma 3), read into the spec.
    - ``megatron_refusal``: why Megatron-Core's ``GPTModel`` cannot express the family
      (every Megatron layout is refused with it), or empty.
    - ``fsdp2_tp_refusal``: why the FSDP2 engine cannot run the family under ``tp > 1``,
      or empty.
    - ``outer``: the checkpoint names of the embedding, final norm and output layer
      (:class:`~areal_fn.model.families.serving.OuterTensors`).
    - ``linear_attention``: some layers are gated-delta-net linear attention, as
      ``layer_types`` / ``full_attention_interval`` say (:mod:`areal_fn.model.linear_attention`).
    - ``sequence_refusal``: why the engines cannot split a sequence over ranks (Ulysses,
      context parallelism) or pack sequences into one row for the family, or empty; a
      ``linear_attention`` family packs all the same (the FSDP2 engine runs its
      linear-attention layers per sequence: ``check_packing``).
    - ``ignored_rope_keys``: ``rope_parameters`` keys that change nothing for text input
      (Qwen3.5's multimodal ``mrope_section``: with one position per token it is plain rope).
    - ``serving``: what the serving and building paths need beyond the tables
      (:class:`~areal_fn.model.families.serving.Serving`: vLLM's fused layout, the
      Megatron builder's yarn rope, engines that cannot serve tied models).
    """

    model_type: str
    architecture: str
    required: tuple[str, ...] = attrs.field(converter=_strs)
    defaults: tuple[tuple[str, object], ...] = attrs.field(converter=_pairs)
    bias_flags: tuple[tuple[str, tuple[str, ...]], ...] = attrs.field(
        converter=lambda v: tuple((k, tuple(f)) for k, f in v)
    )
    fixed: tuple[tuple[str, object], ...] = attrs.field(converter=_pairs)
    head_dim_required: bool = False
    hidden_divisible_by_heads: bool = False
    moe: bool = False
    fused_experts: tuple[FusedExperts, ...] = attrs.field(default=(), converter=_fused_tuple)
    canonical: tuple[HfTensor, ...] = attrs.field(
        converter=_canonical_tuple, validator=_check_canonical
    )
    megatron: tuple[MegatronTensor, ...] = attrs.field(
        converter=_megatron_tuple, validator=_check_megatron
    )
    hidden_act: str = "silu"
    sliding_window: SlidingWindow = attrs.field(
        default="absent",
        validator=attrs.validators.in_(
            ("absent", "max_window_layers", "all_layers", "when_set", "layer_types")
        ),
    )
    clamped_swiglu: bool = False
    key_sources: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=lambda v: tuple((str(a), str(b)) for a, b in v)
    )
    must_be: tuple[tuple[str, object], ...] = attrs.field(default=(), converter=_pairs)
    foreign_keys: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=lambda v: tuple((str(a), str(b)) for a, b in v)
    )
    partial_rotary: bool = False
    rotary_dim_key: str | None = None
    mla: bool = False
    indexer: Literal["", "every_layer", "indexer_types"] = attrs.field(
        default="", validator=attrs.validators.in_(("", "every_layer", "indexer_types"))
    )
    first_k_dense: str | None = None
    mtp: MtpBlock | None = None
    moe_keys: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=lambda v: tuple((str(a), str(b)) for a, b in v)
    )
    memory_names: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=lambda v: tuple((str(a), str(b)) for a, b in v)
    )
    act_key: str = "hidden_act"
    sliding_every: int = 2
    sliding_every_key: str | None = None
    layer_rope: bool = False
    attn_scalar: bool = False
    megatron_refusal: str = ""
    fsdp2_tp_refusal: str = ""
    linear_attention: bool = False
    sequence_refusal: str = ""
    ignored_rope_keys: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    serving: Serving = attrs.field(factory=Serving)
    outer: OuterTensors = attrs.field(factory=OuterTensors)

    def default(self, key: str) -> object:
        for k, v in self.defaults:
            if k == key:
                return v
        raise KeyError(key)

    def has_default(self, key: str) -> bool:
        return any(k == key for k, _ in self.defaults)


def _registry() -> dict[str, Family]:
    """Every :class:`Family` that a module of this package holds at top level (its
    ``FAMILY``, and any other, e.g. ``qwen3_5.MOE_FAMILY``): adding a family is adding
    its module."""
    import importlib
    import pkgutil

    fams: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Family):
                fams.setdefault(value.model_type, value)
    return dict(sorted(fams.items()))


#: ``model_type`` values of published configs that transformers has no class for, and the
#: family whose architecture they declare (Kimi-K2's ``kimi_k2`` configs name
#: ``DeepseekV3ForCausalLM``).
MODEL_TYPE_ALIASES: tuple[tuple[str, str], ...] = (("kimi_k2", "deepseek_v3"),)


@attrs.frozen(kw_only=True)
class OtherPart:
    """Tensors of a multimodal checkpoint that are not its text model: those whose names
    start with ``prefix``, what they are (``what``, said in messages), and whether they
    are its multi-token-prediction layers (``mtp``)."""

    prefix: str
    what: str
    mtp: bool = False


@attrs.frozen(kw_only=True)
class TextConfigType:
    """A published multimodal ``model_type`` whose text model is a family: its config's
    ``text_config`` (of ``text_model_type``) is read, and its checkpoint stores the text
    model's tensors under other names: a stored name starting with the first prefix of a
    ``renamed`` pair is the canonical name with the second prefix instead (names under
    no such prefix are canonical as stored); ``others`` are the parts that are not the
    text model."""

    model_type: str
    text_model_type: str
    renamed: tuple[tuple[str, str], ...]
    others: tuple[OtherPart, ...]


_QWEN3_5_RENAMED = (("model.language_model.", "model."),)
_QWEN3_5_OTHERS = (
    OtherPart(prefix="model.visual.", what="the vision encoder"),
    OtherPart(prefix="mtp.", what="the multi-token-prediction layers", mtp=True),
)

#: Published multimodal configs whose text model is a family: the config's
#: ``text_config`` is read (Qwen3.5's ``qwen3_5`` holds a ``qwen3_5_text``), and the
#: checkpoint read as the text model (``model.language_model.*`` as ``model.*``).
TEXT_CONFIG_TYPES: tuple[TextConfigType, ...] = (
    TextConfigType(
        model_type="qwen3_5",
        text_model_type="qwen3_5_text",
        renamed=_QWEN3_5_RENAMED,
        others=_QWEN3_5_OTHERS,
    ),
    TextConfigType(
        model_type="qwen3_5_moe",
        text_model_type="qwen3_5_moe_text",
        renamed=_QWEN3_5_RENAMED,
        others=_QWEN3_5_OTHERS,
    ),
)

#: Every supported family, keyed by ``model_type`` (sorted).
FAMILIES: dict[str, Family] = _registry()


@beartype
def family(model_type: str) -> Family:
    """The family of ``model_type``; a :class:`SpecError` naming the supported set otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise SpecError(
            f"model_type={model_type!r} is not supported; supported model types are "
            f"{sorted(FAMILIES)}; add a family module under areal_fn/model/families/ for it"
        ) from None
