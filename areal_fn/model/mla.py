"""Multi-latent attention (DeepSeek-V3, Kimi-K2): its config keys and the rules on them.

A multi-latent attention layer projects queries through a LoRA (``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``; ``q_proj`` alone when ``q_lora_rank`` is null) and
keys/values through a shared compressed latent (``kv_a_proj_with_mqa`` gives
``kv_lora_rank`` latent dims plus one ``qk_rope_head_dim`` rope key shared by every
head; ``kv_a_layernorm``; ``kv_b_proj`` gives each head ``[k_nope; v]``). The
query/key head size is ``qk_nope_head_dim + qk_rope_head_dim``, which
:class:`~areal_fn.model.spec.ModelSpec` holds as ``head_dim``; the values have
``v_head_dim`` dims per head. transformers' config writes ``head_dim`` as
``qk_rope_head_dim`` (the rotary size), which :func:`mla_fields` checks and
:func:`mla_config` writes back.
"""

from collections.abc import Callable, Mapping
from typing import Any

from areal_fn.errors import SpecError
from areal_fn.model.dsa import dsa_config, dsa_fields
from areal_fn.model.families import family

#: ModelSpec fields only multi-latent attention sets (0 / True elsewhere).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")


def check_mla(spec: Any) -> None:
    """The multi-latent attention fields of a :class:`~areal_fn.model.spec.ModelSpec`
    are consistent with its family."""
    values = {f: getattr(spec, f) for f in MLA_FIELDS}
    if not spec.family.mla:
        if any(values.values()) or not spec.rope_interleave:
            raise SpecError(
                f"{spec.model_type} has grouped-query attention, but its multi-latent "
                f"attention fields are {values}, rope_interleave={spec.rope_interleave}; leave "
                "them at 0 / True or use a multi-latent family (deepseek_v3)"
            )
        return
    for name in ("kv_lora_rank", "v_head_dim"):
        if values[name] < 1:
            raise SpecError(
                f"{spec.model_type}: {name}={values[name]} must be >= 1 for multi-latent attention"
            )
    rope = spec.qk_rope_head_dim
    if rope < 2 or rope % 2:
        raise SpecError(
            f"{spec.model_type}: qk_rope_head_dim={rope} must be even and >= 2; rotary "
            "embeddings rotate pairs of dims"
        )
    if spec.head_dim <= rope:
        raise SpecError(
            f"{spec.model_type}: head_dim={spec.head_dim} (qk_nope_head_dim + "
            f"qk_rope_head_dim) must exceed qk_rope_head_dim={rope}; qk_nope_head_dim must "
            "be >= 1"
        )
    if spec.num_key_value_heads != spec.num_attention_heads:
        raise SpecError(
            f"{spec.model_type}: num_key_value_heads={spec.num_key_value_heads} but "
            f"num_attention_heads={spec.num_attention_heads}; multi-latent attention has "
            "no shared KV heads (every head gets its own keys and values from the latent), "
            "so the two must be equal"
        )


def mla_fields(
    raw: Mapping[str, object],
    get: Callable[[str], object],
    integer: Callable[[str, int], int],
    model_type: str,
) -> dict[str, object]:
    """The :class:`~areal_fn.model.spec.ModelSpec` fields of a multi-latent config
    ``raw`` (``get`` reads a key with the family's defaults, ``integer`` an int key with a
    minimum). An explicit ``q_lora_rank: null`` means no query LoRA (``q_proj``); an
    absent one is the config class's default."""
    q_lora = raw["q_lora_rank"] if "q_lora_rank" in raw else get("q_lora_rank")
    rope = integer("qk_rope_head_dim", 1)
    written = get("head_dim")
    if written is not None and written != rope:
        raise SpecError(
            f"{model_type} config has head_dim={written!r} but qk_rope_head_dim={rope}; "
            "transformers' config sets head_dim to qk_rope_head_dim (the rotary size); "
            "remove head_dim or make it equal"
        )
    interleave = get("rope_interleave")
    if not isinstance(interleave, bool):
        raise SpecError(f"rope_interleave={interleave!r} must be true or false")
    return {
        "q_lora_rank": 0 if q_lora is None else integer("q_lora_rank", 1),
        "kv_lora_rank": integer("kv_lora_rank", 1),
        "qk_rope_head_dim": rope,
        "v_head_dim": integer("v_head_dim", 1),
        "head_dim": integer("qk_nope_head_dim", 1) + rope,
        "rope_interleave": interleave,
        **dsa_fields(raw, family(model_type), integer),
    }


def mla_config(spec: Any) -> dict[str, object]:
    """The ``config.json`` keys of ``spec``'s multi-latent attention."""
    return {
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "head_dim": spec.qk_rope_head_dim,
        "rope_interleave": spec.rope_interleave,
        **dsa_config(spec),
    }
