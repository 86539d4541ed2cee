"""Hypothesis strategies for HF model configs and :class:`~areal_fn.model.spec.ModelSpec`.

:func:`hf_configs` draws tiny ``config.json`` dicts that are valid by construction for
:func:`~areal_fn.model.spec.model_from_hf_config` *and* for transformers (heads are drawn as
``num_key_value_heads * group``, ``head_dim`` is drawn even, MoE top-k is drawn inside
``1..num_experts``); optional keys are sometimes omitted so family defaults get
exercised. Everything shrinks towards one layer, one head, small sizes and omitted keys.
"""

from hypothesis import strategies as st

from areal_fn.model.families import FAMILIES, Family
from areal_fn.model.families import family as _family
from areal_fn.model.spec import ModelSpec, model_from_hf_config

#: Every family name, sorted.
FAMILY_NAMES: tuple[str, ...] = tuple(sorted(FAMILIES))

#: The families Megatron-Core can express (the others' Megatron layouts are refused:
#: :attr:`~areal_fn.model.families.Family.megatron_refusal`), sorted.
MEGATRON_FAMILY_NAMES: tuple[str, ...] = tuple(
    n for n in FAMILY_NAMES if not FAMILIES[n].megatron_refusal
)

#: The families that model sliding-window layers (``layer_types``), sorted.
SLIDING_FAMILY_NAMES: tuple[str, ...] = tuple(
    n for n in FAMILY_NAMES if FAMILIES[n].sliding_window == "layer_types"
)

_DTYPES = ("float32", "bfloat16", "float16")


def _maybe(draw: st.DrawFn, cfg: dict[str, object], key: str, strategy: st.SearchStrategy) -> None:
    """Set ``cfg[key]`` from ``strategy`` or leave it out (shrinks towards leaving it out)."""
    if draw(st.booleans()):
        cfg[key] = draw(strategy)


@st.composite
def hf_configs(
    draw: st.DrawFn,
    family: str | None = None,
    *,
    max_layers: int = 4,
    max_kv_heads: int = 3,
    max_group: int = 3,
    max_experts: int = 4,
    megatron: bool = False,
) -> dict[str, object]:
    """A tiny, valid ``config.json`` dict of ``family`` (any family when None; with
    ``megatron``, any of :data:`MEGATRON_FAMILY_NAMES`)."""
    names = MEGATRON_FAMILY_NAMES if megatron else FAMILY_NAMES
    name = draw(st.sampled_from(names)) if family is None else family
    fam = _family(name)
    if fam.mla:
        return _mla_config(draw, name, max_layers=max_layers, max_experts=max_experts)
    kv = draw(st.integers(1, max_kv_heads))
    heads = kv * draw(st.integers(1, max_group))
    # partial rotary (a factor of 0.5) needs an even number of rotated dims
    head_dim = (4 if fam.partial_rotary else 2) * draw(st.integers(1, 4))
    layers = draw(st.integers(2 if fam.first_k_dense else 1, max(max_layers, 2)))
    # a family whose config class defaults head_dim to a number (MiniMax-M2: 128) is
    # drawn with it explicit, so the tiny model stays tiny
    fixed_head_dim = fam.has_default("head_dim") and fam.default("head_dim") is not None
    explicit_head_dim = fam.head_dim_required or fixed_head_dim or draw(st.booleans())
    if not explicit_head_dim:
        hidden = heads * head_dim
    elif fam.hidden_divisible_by_heads:
        hidden = heads * draw(st.integers(1, 4))
    else:
        hidden = draw(st.integers(1, 16))
    cfg: dict[str, object] = {
        "model_type": name,
        "hidden_size": hidden,
        "intermediate_size": draw(st.integers(1, 16)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        # two tokens at least: OLMo's embeddings pad token 1 (pad_token_id's default)
        "vocab_size": draw(st.integers(2, 64)),
    }
    kv_default = (
        fam.default("num_key_value_heads") if fam.has_default("num_key_value_heads") else None
    )
    if (
        "num_key_value_heads" in fam.required
        or kv != heads
        or kv_default is not None
        or draw(st.booleans())
    ):
        cfg["num_key_value_heads"] = kv
    if explicit_head_dim:
        cfg["head_dim"] = head_dim
    _maybe(draw, cfg, "tie_word_embeddings", st.booleans())
    _maybe(draw, cfg, "rms_norm_eps", st.sampled_from([1e-6, 1e-5]))
    _maybe(draw, cfg, "rope_theta", st.sampled_from([10000.0, 500000.0, 1000000]))
    _maybe(draw, cfg, "max_position_embeddings", st.integers(16, 4096))
    _maybe(draw, cfg, "torch_dtype", st.sampled_from(_DTYPES))
    for key, _fields in fam.bias_flags:
        _maybe(draw, cfg, key, st.booleans())
    if name == "llama" and draw(st.booleans()):
        cfg["rope_scaling"] = {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
            "rope_type": "llama3",
        }
    if fam.sliding_window == "when_set":
        cfg["sliding_window"] = None  # a window is refused (no family models one)
    if fam.rotary_dim_key and draw(st.booleans()):
        cfg[fam.rotary_dim_key] = draw(st.sampled_from([head_dim // 2, head_dim]))
    elif fam.partial_rotary:
        _maybe(draw, cfg, "partial_rotary_factor", st.sampled_from([0.5, 1.0]))
    _draw_moe(draw, cfg, name, layers, max_experts)
    return cfg


def _mla_config(
    draw: st.DrawFn, name: str, *, max_layers: int, max_experts: int
) -> dict[str, object]:
    """A multi-latent attention config (DeepSeek-V3): every head has its own keys and
    values, so there are no KV heads to draw; the query LoRA is sometimes absent."""
    layers = draw(st.integers(2, max(max_layers, 2)))
    cfg: dict[str, object] = {
        "model_type": name,
        "hidden_size": draw(st.integers(1, 16)),
        "intermediate_size": draw(st.integers(1, 16)),
        "num_hidden_layers": layers,
        "num_attention_heads": draw(st.integers(1, 4)),
        "vocab_size": draw(st.integers(1, 64)),
        # DeepSeek sparse attention's indexer reads the query LoRA: never absent there
        "q_lora_rank": draw(
            st.integers(1, 8) if _family(name).indexer else st.one_of(st.none(), st.integers(1, 8))
        ),
        "kv_lora_rank": draw(st.integers(1, 8)),
        "qk_nope_head_dim": draw(st.integers(1, 6)),
        "qk_rope_head_dim": 2 * draw(st.integers(1, 3)),
        "v_head_dim": draw(st.integers(1, 6)),
    }
    if draw(st.booleans()):
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    _maybe(draw, cfg, "tie_word_embeddings", st.booleans())
    _maybe(draw, cfg, "rms_norm_eps", st.sampled_from([1e-6, 1e-5]))
    _maybe(draw, cfg, "max_position_embeddings", st.integers(16, 4096))
    _maybe(draw, cfg, "torch_dtype", st.sampled_from(_DTYPES))
    _draw_moe(draw, cfg, name, layers, max_experts)
    if _family(name).indexer:
        _draw_indexer(draw, cfg, name, layers)
    return cfg


def _draw_indexer(draw: st.DrawFn, cfg: dict[str, object], name: str, layers: int) -> None:
    """DeepSeek sparse attention's indexer keys: heads, a head at least as wide as the
    rope dims, top-k; GLM-5's ``indexer_types`` (layer 0 full) or its freq/offset rule."""
    rope = cfg["qk_rope_head_dim"]
    assert isinstance(rope, int)
    cfg["index_n_heads"] = draw(st.integers(1, 3))
    cfg["index_head_dim"] = rope + draw(st.integers(0, 4))
    cfg["index_topk"] = draw(st.integers(1, 8))
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]  # the class default is 128
    if _family(name).indexer != "indexer_types":
        return
    if draw(st.booleans()):
        kinds = st.sampled_from(["full", "shared"])
        rest = draw(st.lists(kinds, min_size=layers - 1, max_size=layers - 1))
        cfg["indexer_types"] = ["full", *rest]
    else:  # an offset of 1 or 2 keeps layer 0 full
        _maybe(draw, cfg, "index_topk_freq", st.integers(1, 3))
        cfg["index_skip_topk_offset"] = draw(st.integers(1, 2))


def _draw_moe(
    draw: st.DrawFn, cfg: dict[str, object], name: str, layers: int, max_experts: int
) -> None:
    """The MoE keys of ``name``'s config (none for a dense family)."""
    fam = _family(name)
    if name in ("glm4_moe", "deepseek_v3") or fam.indexer:
        groups = draw(st.integers(1, 2))
        experts = groups * draw(st.integers(1, max(1, max_experts // groups)))
        group_topk = draw(st.integers(1, groups))
        cfg["n_routed_experts"] = experts
        cfg["n_group"] = groups
        cfg["topk_group"] = group_topk
        cfg["num_experts_per_tok"] = draw(st.integers(1, experts // groups * group_topk))
        cfg["moe_intermediate_size"] = draw(st.integers(1, 16))
        cfg["first_k_dense_replace"] = draw(st.integers(0, layers - 1))
        _maybe(draw, cfg, "n_shared_experts", st.integers(1, 2))
        _maybe(draw, cfg, "routed_scaling_factor", st.sampled_from([1.0, 2.5]))
        _maybe(draw, cfg, "norm_topk_prob", st.booleans())
        _maybe(draw, cfg, "num_nextn_predict_layers", st.integers(0, 2))
    elif name in ("mixtral", "minimax_m2"):
        experts = draw(st.integers(1, max_experts))
        cfg["num_local_experts"] = experts
        cfg["num_experts_per_tok"] = draw(st.integers(1, experts))
    elif name == "gpt_oss":
        _draw_gpt_oss(draw, cfg, max_experts)
    elif fam.sliding_window == "layer_types":
        _draw_layer_types(draw, cfg, fam)
    elif fam.linear_attention:
        _draw_linear(draw, cfg, fam, layers, max_experts)
    elif fam.moe:
        experts = draw(st.integers(1, max_experts))
        cfg["num_local_experts" if draw(st.booleans()) else "num_experts"] = experts
        cfg["num_experts_per_tok"] = draw(st.integers(1, experts))
        cfg["moe_intermediate_size"] = draw(st.integers(1, 16))
        _maybe(draw, cfg, "decoder_sparse_step", st.integers(1, 3))
        _maybe(draw, cfg, "mlp_only_layers", st.lists(st.integers(0, layers - 1), unique=True))
        _maybe(draw, cfg, "norm_topk_prob", st.booleans())


def _draw_gpt_oss(draw: st.DrawFn, cfg: dict[str, object], max_experts: int) -> None:
    """gpt-oss: every layer MoE; sliding windows on the default layers;
    clamped SwiGLU; yarn rope by default, plain sometimes."""
    experts = draw(st.integers(1, max_experts))
    cfg["num_local_experts"] = experts
    cfg["num_experts_per_tok"] = draw(st.integers(1, experts))
    _maybe(draw, cfg, "sliding_window", st.integers(1, 8))
    # no layer_types: callers may change num_hidden_layers after the draw; the default
    # (even layers slide) follows it, and gpt_oss_layer_types draws explicit patterns
    _maybe(draw, cfg, "swiglu_limit", st.sampled_from([7.0, 3.5]))
    _maybe(draw, cfg, "rope_scaling", st.just({"rope_type": "default"}))


def _draw_layer_types(draw: st.DrawFn, cfg: dict[str, object], fam: Family) -> None:
    """A dense family with sliding layers (OLMo 3, Gemma 3): the window, the pattern key,
    Gemma 3's local rope base and attention scalar; the layers follow the default pattern
    (:func:`sliding_layer_types` draws explicit ones)."""
    _maybe(draw, cfg, "sliding_window", st.integers(1, 8))
    if fam.sliding_every_key:
        _maybe(draw, cfg, fam.sliding_every_key, st.integers(1, 4))
    if fam.has_default("rope_local_base_freq"):
        _maybe(draw, cfg, "rope_local_base_freq", st.sampled_from([10000.0, 1000.0]))
    if fam.attn_scalar:
        _maybe(draw, cfg, "query_pre_attn_scalar", st.integers(1, 64))
    if not fam.has_default("rope_local_base_freq") and "rope_theta" in cfg:
        # one base for both layer types: nested, as transformers applies a top-level
        # rope_theta to the full-attention layers only
        theta = cfg.pop("rope_theta")
        cfg["rope_parameters"] = {
            kind: {"rope_type": "default", "rope_theta": theta}
            for kind in ("full_attention", "sliding_attention")
        }


@st.composite
def gpt_oss_layer_types(draw: st.DrawFn, cfg: dict[str, object]) -> dict[str, object]:
    """``cfg`` (a config of a family with sliding layers: gpt-oss, OLMo 3, Gemma 3) with
    an explicit ``layer_types`` pattern drawn."""
    layers = int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
    kinds = st.sampled_from(["sliding_attention", "full_attention"])
    return {**cfg, "layer_types": draw(st.lists(kinds, min_size=layers, max_size=layers))}


@st.composite
def model_specs(
    draw: st.DrawFn,
    family: str | None = None,
    *,
    mtp: bool = False,
    megatron: bool = False,
    **kwargs: int,
) -> ModelSpec:
    """A :class:`ModelSpec` of a tiny config drawn by :func:`hf_configs` (``mtp``: with
    the multi-token-prediction layers the config declares; ``megatron``: of a family
    Megatron-Core can express)."""
    return model_from_hf_config(draw(hf_configs(family, megatron=megatron, **kwargs)), mtp=mtp)


def _draw_linear(
    draw: st.DrawFn, cfg: dict[str, object], fam: Family, layers: int, max_experts: int
) -> None:
    """Qwen3-Next, Qwen3.5: head_dim a multiple of 8 (a quarter of it rotates, in pairs),
    small gated-delta-net heads, the layer kinds from the interval (default 4), and
    the MoE keys with the gated shared expert (Qwen3.5-MoE: no dense MLP keys)."""
    cfg["head_dim"] = 8 * draw(st.integers(1, 2))
    key_heads = draw(st.integers(1, 2))
    cfg["linear_num_key_heads"] = key_heads
    cfg["linear_num_value_heads"] = key_heads * draw(st.integers(1, 2))
    cfg["linear_key_head_dim"] = draw(st.integers(1, 6))
    cfg["linear_value_head_dim"] = draw(st.integers(1, 6))
    cfg["linear_conv_kernel_dim"] = draw(st.integers(1, 4))
    # no layer_types: callers may change num_hidden_layers after the draw (as gpt-oss)
    _maybe(draw, cfg, "full_attention_interval", st.integers(1, 3))
    if not fam.moe:
        return
    experts = draw(st.integers(1, max_experts))
    cfg["num_experts"] = experts
    cfg["num_experts_per_tok"] = draw(st.integers(1, experts))
    cfg["moe_intermediate_size"] = draw(st.integers(1, 16))
    cfg["shared_expert_intermediate_size"] = draw(st.integers(1, 16))
    if fam.has_default("norm_topk_prob"):  # Qwen3-Next; Qwen3.5-MoE has every layer MoE
        _maybe(draw, cfg, "decoder_sparse_step", st.integers(1, 3))
        _maybe(draw, cfg, "mlp_only_layers", st.lists(st.integers(0, layers - 1), unique=True))
        _maybe(draw, cfg, "norm_topk_prob", st.booleans())
    else:
        cfg.pop("intermediate_size")
