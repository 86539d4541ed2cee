"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the indexer's config keys and rules.

A DSA layer is multi-latent attention (:mod:`areal_fn.model.mla`) plus a lightning
indexer that picks, for each query, the ``index_topk`` keys the attention may see. The
indexer holds ``self_attn.indexer.wq_b`` ``[index_n_heads * index_head_dim,
q_lora_rank]`` (it reads the query LoRA's normed latent), ``wk`` ``[index_head_dim,
hidden]``, a LayerNorm ``k_norm`` (weight and bias, ``[index_head_dim]``) and
``weights_proj`` ``[index_n_heads, hidden]``. Its first ``qk_rope_head_dim`` dims are
rotated. transformers runs it under ``torch.no_grad``: its weights get no gradient from
the language-model loss.

``ModelSpec.indexer_layers[i]`` is true when layer ``i`` runs an indexer of its own
(every layer for DeepSeek-V3.2); GLM-5's ``indexer_types`` marks layers ``"shared"``
that reuse the top-k of the last ``"full"`` layer before them and hold no indexer
tensors. The table records of the indexer name ``when="index_n_heads"``, which
:func:`layer_flags` sets to 0 on a shared layer.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from areal_fn.errors import SpecError, UnsupportedConfigError

#: ModelSpec fields only DeepSeek sparse attention sets (0 / empty elsewhere).
DSA_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")

#: The attention kind transformers writes in ``layer_types`` for a DSA layer.
INDEXED = "indexed_attention"


def _indexer_types(
    cfg: Mapping[str, object], layers: int, integer: Callable[[str, int], int]
) -> tuple[bool, ...]:
    """GLM-5's per-layer indexer: ``indexer_types`` (``"full"``/``"shared"``), else
    ``index_topk_pattern`` (``"F"``/``"S"`` per layer), else layer ``i`` is full when
    ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2, 1),
    as transformers' config derives it."""
    kinds = cfg.get("indexer_types")
    pattern = cfg.get("index_topk_pattern")
    if kinds is None and isinstance(pattern, str):
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    elif kinds is None and pattern is not None:
        kinds = pattern
    if kinds is None:
        freq = max(integer("index_topk_freq", 1) if "index_topk_freq" in cfg else 1, 1)
        offset = integer("index_skip_topk_offset", 0) if "index_skip_topk_offset" in cfg else 2
        return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(layers))
    if isinstance(kinds, str) or not isinstance(kinds, Sequence) or len(kinds) != layers:
        raise SpecError(
            f"indexer_types={kinds!r} must be a list of 'full'/'shared', one per layer "
            f"(num_hidden_layers={layers})"
        )
    bad = [k for k in kinds if k not in ("full", "shared")]
    if bad:
        raise SpecError(
            f"indexer_types has {bad[0]!r}; each layer's indexer is 'full' (its own) or "
            f"'shared' (the top-k of the last full layer before it)"
        )
    return tuple(k == "full" for k in kinds)


def dsa_fields(
    cfg: Mapping[str, object], fam: Any, integer: Callable[[str, int], int]
) -> dict[str, object]:
    """The :class:`~areal_fn.model.spec.ModelSpec` fields of the indexer of a DSA config
    ``cfg`` (none for a family without one; ``integer`` reads an int key with the
    family's defaults and a minimum)."""
    if not fam.indexer:
        return {}
    mt, layers = fam.model_type, integer("num_hidden_layers", 1)
    dense = min(integer("first_k_dense_replace", 0), layers)
    _check_mlp_layer_types(cfg, (False,) * dense + (True,) * (layers - dense))
    kinds = cfg.get("layer_types")
    if kinds is not None and (
        isinstance(kinds, str) or not isinstance(kinds, Sequence) or set(kinds) != {INDEXED}
    ):
        raise UnsupportedConfigError(
            f"{mt} config has layer_types={kinds!r}; the {mt} family models "
            f"{INDEXED!r} layers only (multi-latent attention with a top-k indexer); remove "
            f"layer_types or list {INDEXED!r} for each of the {layers} layers"
        )
    if fam.indexer == "indexer_types":
        per_layer = _indexer_types(cfg, layers, integer)
    else:
        per_layer = (True,) * layers
    return {
        "index_n_heads": integer("index_n_heads", 1),
        "index_head_dim": integer("index_head_dim", 1),
        "index_topk": integer("index_topk", 1),
        "indexer_layers": per_layer,
    }


def _check_mlp_layer_types(cfg: Mapping[str, object], moe_layers: tuple[bool, ...]) -> None:
    """transformers builds layer ``i``'s MLP from ``mlp_layer_types[i]`` when the config
    gives it; it must say what ``first_k_dense_replace`` says."""
    given = cfg.get("mlp_layer_types")
    if given is None:
        return
    want = ["sparse" if m else "dense" for m in moe_layers]
    if isinstance(given, str) or not isinstance(given, Sequence) or list(given) != want:
        dense = want.count("dense")
        raise SpecError(
            f"mlp_layer_types={given!r} disagrees with first_k_dense_replace={dense}, which "
            f"gives {want}; make them agree or remove mlp_layer_types"
        )


def check_dsa(spec: Any) -> None:
    """The indexer fields of a :class:`~areal_fn.model.spec.ModelSpec` are consistent."""
    values = {f: getattr(spec, f) for f in DSA_FIELDS}
    mt = spec.model_type
    if not spec.family.indexer:
        if any(values.values()) or spec.indexer_layers:
            raise SpecError(
                f"{mt} has no sparse-attention indexer, but its indexer fields are {values}, "
                f"indexer_layers={spec.indexer_layers}; leave them at 0 / () or use a DSA "
                "family (deepseek_v32, glm_moe_dsa)"
            )
        return
    for name, value in values.items():
        if value < 1:
            raise SpecError(f"{mt}: {name}={value} must be >= 1 for sparse attention")
    if len(spec.indexer_layers) != spec.num_layers:
        raise SpecError(
            f"{mt}: indexer_layers has {len(spec.indexer_layers)} entries but num_layers="
            f"{spec.num_layers}; give one per layer"
        )
    if not spec.indexer_layers[0]:
        raise SpecError(
            f"{mt}: layer 0's indexer is 'shared', but a shared layer reuses the top-k of an "
            "earlier 'full' layer and there is none; make layer 0 'full'"
        )
    if spec.index_head_dim < spec.qk_rope_head_dim:
        raise SpecError(
            f"{mt}: index_head_dim={spec.index_head_dim} is below qk_rope_head_dim="
            f"{spec.qk_rope_head_dim}; the indexer rotates its first qk_rope_head_dim dims"
        )
    if spec.q_lora_rank < 1:
        raise SpecError(
            f"{mt}: q_lora_rank={spec.q_lora_rank}; the indexer's wq_b reads the query "
            "LoRA's latent, so sparse attention needs q_lora_rank >= 1"
        )


def layer_flags(spec: Any, flags: Mapping[str, object], layer: int) -> Mapping[str, object]:
    """The table conditions of decoder layer ``layer``: ``flags`` with ``index_n_heads``
    0 where the layer holds no indexer of its own."""
    if not spec.indexer_layers or spec.indexer_layers[layer]:
        return flags
    return {**flags, "index_n_heads": 0}


def dsa_config(spec: Any) -> dict[str, object]:
    """The ``config.json`` keys of ``spec``'s indexer (none without one)."""
    if not spec.family.indexer:
        return {}
    out: dict[str, object] = {f: getattr(spec, f) for f in DSA_FIELDS}
    if spec.family.indexer == "indexer_types":
        out["indexer_types"] = ["full" if f else "shared" for f in spec.indexer_layers]
    return out
