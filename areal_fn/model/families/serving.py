"""What a family says beyond its decoder-layer tables: the tensors outside the layers
(:class:`OuterTensors`) and what its serving and building paths need (:class:`Serving`),
two fields of :class:`~areal_fn.model.families.Family`.

The specs, layouts, memory estimates, strategy rules, the vLLM layout and the Megatron
builder read these fields; none of them names a ``model_type`` or these tensors.
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
    - ``megatron_gated_delta``: the Megatron builder builds the family's gated-delta-net
      layers (Megatron-Core's ``GatedDeltaNet`` where ``ModelSpec.linear_attention`` says),
      the sigmoid gate of its attention output and its ``(1 + w)`` norms
      (:mod:`areal_fn.runtime.megatron.gated_delta`; logits parity proven for it);
    - ``tied_refusals``: engines that cannot serve the family's tied models.
    """

    vllm_layout: bool = False
    megatron_yarn: bool = False
    megatron_gated_delta: bool = False
    tied_refusals: tuple[TiedRefusal, ...] = attrs.field(default=(), converter=_refusals)


@attrs.frozen(kw_only=True)
class OuterTensors:
    """The checkpoint names of the tensors outside the decoder layers: the token
    ``embedding`` ``[vocab, hidden]``, the ``final_norm`` ``[hidden]`` and the ``output``
    layer ``[vocab, hidden]`` (absent from a tied model's checkpoint, where the
    embedding serves). The default is every supported family's (Llama's naming)."""

    embedding: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    output: str = "lm_head.weight"

    @property
    def embedding_module(self) -> str:
        """The module holding :attr:`embedding` (its name without ``.weight``)."""
        return self.embedding.removesuffix(".weight")
