"""What a family with sliding-window layers reads from its config (gpt-oss, OLMo 3,
Gemma 3): which layers slide, the window, and the rope of each layer type.

:func:`sliding_fields` gives ``ModelSpec.sliding_window`` and ``sliding_layers``: the
layers ``layer_types`` marks ``sliding_attention``, by default every layer but each
``sliding_every``-th (:attr:`~areal_fn.model.families.Family.sliding_every`). A family
with ``layer_rope`` (OLMo 3, Gemma 3) applies rope scaling to its full-attention
layers only; Gemma 3's sliding layers rotate with a base of their own. transformers 5
may write such a config's ``rope_parameters`` nested by layer type
(``{"full_attention": {...}, "sliding_attention": {...}}``): :func:`split_layer_rope`
reads the full-attention entry as the rope and the sliding one as the local base.
"""

from collections.abc import Callable, Mapping
from typing import Any

from areal_fn.errors import SpecError, UnsupportedConfigError
from areal_fn.model.families import Family

_KINDS = ("full_attention", "sliding_attention")


def sliding_fields(
    cfg: Mapping[str, object], fam: Family, layers: int, integer: Callable[[str], int]
) -> dict[str, object]:
    """``sliding_window`` and ``sliding_layers`` of a family that models sliding windows.

    A null window is refused: transformers' models of these families build a
    sliding-window mask in every forward and fail without one. ``integer`` reads a
    config key (with the family's default) as a positive int.
    """
    kinds = cfg.get("layer_types")
    if kinds is None:
        every = integer(fam.sliding_every_key) if fam.sliding_every_key else fam.sliding_every
        kinds = [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ]
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        mt = fam.model_type
        raise UnsupportedConfigError(
            f"{mt} config has sliding_window=None; transformers' {mt} model builds a "
            "sliding-window mask in every forward and fails without a window (even with every "
            f"layer full_attention); give a window ({fam.default('sliding_window')} is the "
            "config class's default)"
        )
    return {
        "sliding_window": integer("sliding_window"),
        "sliding_layers": tuple(k == "sliding_attention" for k in kinds),  # type: ignore[attr-defined]
    }


def split_layer_rope(cfg: Mapping[str, object], fam: Family) -> tuple[dict[str, object], object]:
    """``cfg`` with nested ``rope_parameters`` replaced by their full-attention entry, and
    the sliding layers' ``rope_theta`` from the sliding entry (``None`` when not nested).

    The sliding layers' rope must be plain (``rope_type`` ``default``); a family without
    a local base (OLMo 3) needs the same base on both layer types.
    """
    out = dict(cfg)
    params = cfg.get("rope_parameters")
    mt = fam.model_type
    if not fam.layer_rope or not isinstance(params, Mapping) or not set(params) & set(_KINDS):
        theta, default = cfg.get("rope_theta"), fam.default("rope_theta")
        if (
            fam.layer_rope
            and not fam.has_default("rope_local_base_freq")
            and theta
            not in (
                None,
                default,
            )
        ):
            raise UnsupportedConfigError(
                f"{mt} config has rope_theta={theta!r} at the top level; transformers' {mt} "
                f"config applies it to the full-attention layers only and rotates the sliding "
                f"ones with its default {default!r}, which the {mt} family (one base) does not "
                "model; nest rope_parameters by layer type with one rope_theta for both "
                "('full_attention' and 'sliding_attention'), as ModelSpec.hf_config() writes"
            )
        return out, None
    if set(params) - set(_KINDS) or not all(isinstance(params.get(k), Mapping) for k in _KINDS):
        raise SpecError(
            f"{mt} config has rope_parameters={dict(params)!r}; nested by layer type it holds "
            f"one mapping for each of {list(_KINDS)} and nothing else"
        )
    full, sliding = dict(params["full_attention"]), dict(params["sliding_attention"])  # type: ignore[call-overload]
    kind = sliding.get("rope_type", "default")
    local = sliding.get("rope_theta")
    if kind != "default":
        raise UnsupportedConfigError(
            f"{mt} config has rope_parameters.sliding_attention.rope_type={kind!r}; the {mt} "
            "family scales the rope of its full-attention layers only; use 'default' there"
        )
    if not fam.has_default("rope_local_base_freq") and local != full.get("rope_theta"):
        raise UnsupportedConfigError(
            f"{mt} config has rope_theta={full.get('rope_theta')!r} on full-attention layers "
            f"and {local!r} on sliding ones; the {mt} family rotates both with one base; give "
            "them the same rope_theta"
        )
    out["rope_parameters"] = full
    return out, local


def layer_type_config(spec: Any, cfg: dict[str, object]) -> dict[str, object]:
    """``cfg`` (a spec's ``hf_config()`` so far) with what a family with sliding layers
    writes: the window and ``layer_types``; Gemma 3's local base, attention scalar and
    activation key; a single base nested by layer type (transformers would apply a
    top-level ``rope_theta`` to the full-attention layers only)."""
    fam = spec.family
    out = dict(cfg)
    if fam.sliding_window == "layer_types":
        out["sliding_window"] = spec.sliding_window
        out["layer_types"] = [_KINDS[1] if s else _KINDS[0] for s in spec.sliding_layers]
    if fam.has_default("rope_local_base_freq"):
        out["rope_local_base_freq"] = spec.rope_local_theta
    if fam.attn_scalar:
        out["query_pre_attn_scalar"] = spec.query_pre_attn_scalar
    if fam.act_key != "hidden_act":
        out[fam.act_key] = fam.hidden_act
    if fam.layer_rope and spec.rope_local_theta is None:
        full = {"rope_type": "default", **(out.pop("rope_scaling") or {})}  # type: ignore[dict-item]
        out["rope_parameters"] = {
            _KINDS[0]: {**full, "rope_theta": out["rope_theta"]},
            _KINDS[1]: {"rope_type": "default", "rope_theta": out.pop("rope_theta")},
        }
    return out
