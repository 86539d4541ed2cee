"""What a family's serving and building paths need to know beyond its tensor tables:
a :class:`Serving` record, one field of :class:`~areal_fn.model.families.Family`.

The strategy rules, the vLLM layout and the Megatron builder read these fields; none of
them names a ``model_type``.
"""

from collections.abc import Iterable

import attrs


@attrs.frozen(kw_only=True)
class TiedRefusal:
    """An inference engine that cannot serve the family with ``tie_word_embeddings``.

    ``engine``: the engine's allocation name (``"sglang"``); ``pp_only``: refused only
    under pipeline parallelism (``pp > 1``), else at any degree; ``reason``: the refusal
    in the user's terms (what the engine's model class does, its file, the remedy).
    """

    engine: str
    pp_only: bool
    reason: str


def _refusals(value: Iterable[TiedRefusal]) -> tuple[TiedRefusal, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Serving:
    """- ``vllm_layout``: :func:`~areal_fn.layouts.vllm.vllm_layout` describes vLLM's own
      fused parameters for the family (proven against vLLM's model classes);
    - ``megatron_yarn``: the Megatron builder gives ``GPTModel`` the family's yarn rope
      (logits parity with transformers proven for it);
    - ``tied_refusals``: engines that cannot serve the family's tied models.
    """

    vllm_layout: bool = False
    megatron_yarn: bool = False
    tied_refusals: tuple[TiedRefusal, ...] = attrs.field(default=(), converter=_refusals)
