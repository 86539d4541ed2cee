"""What a family says beyond its decoder-layer tables: the tensors outside the layers
(:class:`OuterTensors`), a multi-token-prediction layer's own tensors (:class:`MtpBlock`)
and what its serving and building paths need (:class:`Serving`), fields of
:class:`~areal_fn.model.families.Family`.

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


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class VllmFused:
    """One of vLLM's fused column-parallel modules: ``module`` (relative to the layer)
    holds, on each ``tp`` rank, that rank's rows of each of ``parts`` in order (their
    ``.weight`` and ``.bias`` alike); ``qkv``: the parts are q, k, v, whose KV heads vLLM
    replicates when ``tp`` exceeds them (``QKVParallelLinear``)."""

    module: str
    parts: tuple[str, ...] = attrs.field(converter=_strs)
    qkv: bool = False


def _fused(value: Iterable[VllmFused]) -> tuple[VllmFused, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class VllmExperts:
    """vLLM's ``FusedMoE``: the per-expert ``gate``, ``up`` and ``down`` projections
    (modules relative to the layer, ``{e}`` the expert) stacked into ``w13`` and ``w2``."""

    gate: str = "mlp.experts.{e}.gate_proj"
    up: str = "mlp.experts.{e}.up_proj"
    down: str = "mlp.experts.{e}.down_proj"
    w13: str = "mlp.experts.routed_experts.w13_weight"
    w2: str = "mlp.experts.routed_experts.w2_weight"


#: vLLM's fused modules of a Llama-named decoder layer.
LLAMA_VLLM_FUSED = (
    VllmFused(
        module="self_attn.qkv_proj",
        parts=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        qkv=True,
    ),
    VllmFused(module="mlp.gate_up_proj", parts=("mlp.gate_proj", "mlp.up_proj")),
)


@attrs.frozen(kw_only=True)
class Serving:
    """- ``vllm_layout``: :func:`~areal_fn.layouts.vllm.vllm_layout` describes vLLM's own
      fused parameters for the family (proven against vLLM's model classes): the fused
      modules ``vllm_fused`` and the routed experts ``vllm_experts`` (Llama's and
      Qwen3-MoE's naming by default);
    - ``megatron_yarn``: the Megatron builder gives ``GPTModel`` the family's yarn rope
      (logits parity with transformers proven for it);
    - ``megatron_gated_delta``: the Megatron builder builds the family's gated-delta-net
      layers (Megatron-Core's ``GatedDeltaNet`` where ``ModelSpec.linear_attention`` says),
      the sigmoid gate of its attention output and its ``(1 + w)`` norms
      (:mod:`areal_fn.runtime.megatron.gated_delta`; logits parity proven for it);
    - ``tied_refusals``: engines that cannot serve the family's tied models.
    """

    vllm_layout: bool = False
    vllm_fused: tuple[VllmFused, ...] = attrs.field(default=LLAMA_VLLM_FUSED, converter=_fused)
    vllm_experts: VllmExperts = attrs.field(factory=VllmExperts)
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


@attrs.frozen(kw_only=True)
class MtpBlock:
    """The checkpoint names, relative to the layer (``model.layers.{i}.``), of a
    multi-token-prediction layer's own tensors around its decoder layer
    (:mod:`areal_fn.model.mtp`): its copy of the token ``embedding`` ``[vocab, hidden]``,
    the norms ``enorm`` and ``hnorm`` ``[hidden]`` of the next token's embedding and of
    the previous depth's hidden state, ``eh_proj`` ``[hidden, 2 * hidden]`` over their
    concatenation, then the ``head_norm`` ``[hidden]`` and the ``head`` ``[vocab, hidden]``.
    The default is DeepSeek-V3's naming (GLM-4.5's too)."""

    embedding: str = "embed_tokens.weight"
    enorm: str = "enorm.weight"
    hnorm: str = "hnorm.weight"
    eh_proj: str = "eh_proj.weight"
    head_norm: str = "shared_head.norm.weight"
    head: str = "shared_head.head.weight"

    @property
    def vocab(self) -> tuple[str, str]:
        """The block's vocabulary tensors: its embedding and its head."""
        return (self.embedding, self.head)
