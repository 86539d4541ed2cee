"""Build Megatron-Core parallel state and tiny ``GPTModel`` s from explicit inputs.

Everything here runs under ``torchrun`` (one process per rank) and works on CPU with
gloo when :mod:`areal_fn.runtime.megatron.cpu` is enabled (:func:`megatron_session`
enables it for you). The model architecture comes in as a plain mapping of
Hugging Face-style fields (see :data:`ARCH_FIELDS`); the parallel sizes as a
:class:`MegatronSizes` record.

Typical use in a worker::

    sizes = MegatronSizes(tp=2, pp=2, vpp=2)
    with megatron_session(sizes, seed=0):
        config = transformer_config(arch, sizes)
        chunks = build_model_chunks(arch, config)
        ...

The model uses Megatron-Core's *local* layer spec (``get_gpt_layer_local_spec``):
plain ``ColumnParallelLinear`` / ``RowParallelLinear``, ``torch.nn.RMSNorm``, unfused
dot-product attention, ``SequentialMLP`` experts. The TransformerEngine spec cannot be
built without TransformerEngine. Under context parallelism the core attention is
replaced (:func:`layer_spec`): by ours on CPU, by Transformer Engine's on a GPU that has it.

This module builds the models; the rest lives in modules of its own and is re-exported
here: sizes and parallel state (:mod:`~areal_fn.runtime.megatron.parallel`), the
``TransformerConfig`` translation (:mod:`~areal_fn.runtime.megatron.config`) and the
forward passes (:mod:`~areal_fn.runtime.megatron.forward`).
"""

from collections.abc import Mapping, Sequence
from typing import Any

from areal_fn.errors import LayoutError
from areal_fn.model.families import FAMILIES
from areal_fn.runtime.megatron.config import ARCH_FIELDS as ARCH_FIELDS
from areal_fn.runtime.megatron.config import arch_field
from areal_fn.runtime.megatron.config import arch_of as arch_of
from areal_fn.runtime.megatron.config import transformer_config as transformer_config
from areal_fn.runtime.megatron.forward import forward_logits as forward_logits
from areal_fn.runtime.megatron.forward import gather_tp_logits as gather_tp_logits
from areal_fn.runtime.megatron.forward import pipeline_forward_logits as pipeline_forward_logits
from areal_fn.runtime.megatron.parallel import ORDER as ORDER
from areal_fn.runtime.megatron.parallel import MegatronSizes as MegatronSizes
from areal_fn.runtime.megatron.parallel import destroy_parallel_state as destroy_parallel_state
from areal_fn.runtime.megatron.parallel import init_distributed as init_distributed
from areal_fn.runtime.megatron.parallel import init_parallel_state as init_parallel_state
from areal_fn.runtime.megatron.parallel import megatron_session as megatron_session
from areal_fn.typecheck import beartype

__all__ = [
    "ARCH_FIELDS",
    "MegatronSizes",
    "build_gpt_model",
    "build_model_chunks",
    "destroy_parallel_state",
    "forward_logits",
    "gather_tp_logits",
    "init_distributed",
    "init_parallel_state",
    "layer_spec",
    "local_layer_offsets",
    "megatron_session",
    "pipeline_forward_logits",
    "rope_kwargs",
    "transformer_config",
    "uses_transformer_engine_cp",
]


@beartype
def layer_spec(arch: Mapping[str, Any], config: Any, *, vp_stage: int | None = None) -> Any:
    """Megatron-Core's local (TransformerEngine-free) spec for ``arch``.

    Dense models: the single layer spec ``get_gpt_layer_local_spec`` (every layer the
    same). MoE models: ``get_gpt_decoder_block_spec`` with ``use_transformer_engine=False``,
    the per-layer specs of this pipeline stage (chunk ``vp_stage``), which is what honours
    ``moe_layer_freq``; the single MoE layer spec would make every layer MoE. Gated-delta-net
    families (``arch["gated_delta"]``): :func:`~areal_fn.runtime.megatron.gated_delta.
    gated_delta_block_spec`.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    mla = bool(arch_field(arch, "kv_lora_rank", 0))
    if arch.get("gated_delta"):
        from areal_fn.runtime.megatron.gated_delta import gated_delta_block_spec

        return gated_delta_block_spec(config, vp_stage=vp_stage)
    if arch.get("num_experts"):
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        layers = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=mla or bool(arch.get("qk_norm", False)),
            normalization="RMSNorm",
            multi_latent_attention=mla,
        )
        layers = [spec]
    _patch(layers, arch, config, mla=mla)
    return spec


def _patch(layers: list[Any], arch: Mapping[str, Any], config: Any, *, mla: bool) -> None:
    """Our core attention and biased expert ``linear_fc2`` in the local layer specs."""
    core = _core_attention(config, mla=mla)
    if core is not None:
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = core
    if arch.get("num_experts") and arch.get("mlp_bias"):
        fc2 = _biased_expert_fc2()
        for layer in layers:
            experts = getattr(layer.submodules.mlp.submodules, "experts", None)
            if experts is not None and experts.submodules is not None:
                experts.submodules.linear_fc2 = fc2


def _mtp_spec(arch: Mapping[str, Any], config: Any, spec: Any, vp_stage: int | None) -> Any:
    """Megatron-Core's MTP block spec for this chunk (``None`` where it has none). Its
    layer is the chunk's last decoder layer's spec, or, in a chunk holding no decoder
    layer (a layout ending ``|mL``), the model's last one, patched as :func:`layer_spec`
    patches them."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    if not getattr(spec, "layer_specs", True):
        last = get_gpt_decoder_layer_specs(config, False, normalization="RMSNorm")[-1]
        _patch([last], arch, config, mla=bool(arch_field(arch, "kv_lora_rank", 0)))
        spec = last
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def _biased_expert_fc2() -> Any:
    """The local ``RowParallelLinear`` for biased experts (gpt-oss), returning a copy of its
    output while gradients are recorded. Megatron-Core 0.16's expert ``MLP`` adds the bias
    in place (``output += bias * scale``) to ``linear_fc2``'s output, which at expert-TP 1
    the tensor-parallel reduce (a custom autograd function) returns as its own input, and
    autograd refuses that in-place write in training."""
    import torch
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class BiasedExpertRowParallelLinear(RowParallelLinear):  # type: ignore[misc]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out, bias = super().forward(*args, **kwargs)
            return (out.clone() if torch.is_grad_enabled() else out), bias

    return BiasedExpertRowParallelLinear


def _core_attention(config: Any, *, mla: bool) -> Any:
    """The core attention replacing the local spec's, or ``None`` to keep it.

    Context parallelism (``cp > 1``): Transformer Engine's ``TEDotProductAttention``
    (Megatron's own CP) when TE is installed and the model is not built on the CPU,
    else :func:`~areal_fn.runtime.megatron.context.context_parallel_attention` (which
    also takes multi-latent attention's ``k_channels`` / ``v_channels``). ``cp = 1``:
    multi-latent attention's adapter (:func:`_mla_core_attention`), else ``None``.
    """
    if config.context_parallel_size > 1:
        if uses_transformer_engine_cp(config):
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            return TEDotProductAttention
        from areal_fn.runtime.megatron.context import context_parallel_attention

        return context_parallel_attention()
    return _mla_core_attention() if mla else None


def uses_transformer_engine_cp(config: Any) -> bool:
    """Whether ``cp > 1`` runs through Transformer Engine's attention: TE installed and the
    CPU redirections off (a GPU run). Then packed rows are refused (TE's causal kernel
    does not read a block-diagonal mask)."""
    import importlib.util

    from areal_fn.runtime.megatron import cpu as megatron_cpu

    return (
        config.context_parallel_size > 1
        and importlib.util.find_spec("transformer_engine") is not None
        and not megatron_cpu.is_enabled()
    )


def _mla_core_attention() -> Any:
    """The local ``DotProductAttention`` for multi-latent attention, which passes
    ``k_channels`` / ``v_channels`` to its core attention: only Transformer Engine's
    accepts them. The local one computes the same with ``kv_channels = v_head_dim``
    (the query/key width comes from the tensors, the softmax scale from MLA)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MlaDotProductAttention(DotProductAttention):  # type: ignore[misc]
        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kw: Any):
            super().__init__(*args, **kw)

    return MlaDotProductAttention


def _rotary_base(theta: float) -> int | float:
    return int(theta) if float(theta).is_integer() else theta


#: The Llama 3 rope parameters Megatron-Core's ``RotaryEmbedding`` fixes (only the factor
#: is an argument); every Llama 3.1 / 3.2 config has these values.
MCORE_LLAMA3_ROPE: Mapping[str, float] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


#: Families whose yarn rope the builder gives GPTModel (``Serving.megatron_yarn``: logits
#: parity with transformers is proven for them: tests/distributed/conversion_worker.py).
YARN_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.serving.megatron_yarn)


@beartype
def rope_kwargs(arch: Mapping[str, Any]) -> dict[str, Any]:
    """``GPTModel``'s rope-scaling arguments for ``arch["rope_scaling"]``.

    ``rope_scaling`` is absent, ``None``, a mapping or ``(key, value)`` pairs (as
    :class:`~areal_fn.model.spec.ModelSpec` holds it). Megatron-Core applies Llama 3's rope
    scaling (``rope_type`` ``llama3``), with :data:`MCORE_LLAMA3_ROPE` fixed:
    ``{"rope_scaling": True, "rope_scaling_factor": factor}``, and yarn for
    :data:`YARN_FAMILIES` (gpt-oss):
    ``{"rope_scaling": False, "position_embedding_type": "yarn"}``, its parameters on the
    config (:func:`~areal_fn.runtime.megatron.config.yarn_attributes`). No scaling (or
    ``rope_type`` ``default``): ``{"rope_scaling": False}``. Anything else GPTModel would
    ignore, computing other rotations than the config asks for: ``LayoutError``.
    """
    if arch_field(arch, "kv_lora_rank", 0):
        return {"rope_scaling": False}  # multi-latent attention: in the config (mla_fields)
    raw = arch.get("rope_scaling")
    items: dict[str, Any] = dict(raw.items() if isinstance(raw, Mapping) else raw or ())
    kind = items.get("rope_type", items.get("type", "default"))
    partial = items.get("partial_rotary_factor")
    if partial not in (None, 1):
        raise LayoutError(
            f"rope scaling {items} has partial_rotary_factor={partial!r}; the Megatron builder "
            f"rotates every head dim (rotary_percent=1.0); use a config without it"
        )
    if kind == "default":
        return {"rope_scaling": False}
    if kind == "yarn" and arch.get("model_type") in YARN_FAMILIES:
        # YarnRotaryEmbedding, its parameters on the config (config.yarn_attributes)
        return {"rope_scaling": False, "position_embedding_type": "yarn"}
    if kind == "llama3":
        wrong = [f"{k}={items.get(k)!r}" for k, v in MCORE_LLAMA3_ROPE.items() if items.get(k) != v]
        factor = items.get("factor")
        if not wrong and isinstance(factor, int | float) and factor > 0:
            return {"rope_scaling": True, "rope_scaling_factor": float(factor)}
        raise LayoutError(
            f"llama3 rope scaling {items} has {', '.join(wrong) or f'factor={factor!r}'}; "
            f"Megatron-Core's GPTModel applies llama3 scaling with a factor > 0 and "
            f"{dict(MCORE_LLAMA3_ROPE)} fixed, so it would compute other rotations; train "
            f"this model with the fsdp backend"
        )
    raise LayoutError(
        f"rope scaling {items} (rope_type={kind!r}) is not applied by Megatron-Core's "
        f"GPTModel, which applies rope_type 'llama3' only (and yarn for "
        f"{', '.join(YARN_FAMILIES)}), so it would compute other "
        f"rotations than the config asks for; train this model with the fsdp backend, or use "
        f"a model without rope scaling"
    )


@beartype
def build_gpt_model(
    arch: Mapping[str, Any],
    config: Any,
    *,
    vp_stage: int | None = None,
    vocab_size: int | None = None,
    parallel_output: bool = True,
) -> Any:
    """One ``GPTModel`` (one virtual-pipeline chunk when ``vp_stage`` is given).

    ``vocab_size`` defaults to ``arch["vocab_size"]``; pass a padded size to mirror a
    trainer that pads the vocabulary (Megatron-Core itself does not pad).
    ``parallel_output=True`` leaves logits vocab-sharded across tensor parallelism.
    ``arch["mtp_layers"]`` (``config.mtp_num_layers``) adds Megatron-Core's MTP block to
    the last chunk (local spec, the chunk's last decoder layer as its layer).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    ignore_virtual = vp_stage is None
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    spec = layer_spec(arch, config, vp_stage=vp_stage)
    rope = {"position_embedding_type": "rope", **rope_kwargs(arch)}
    # None except on the chunk where Megatron-Core puts the MTP layers (the last one)
    mtp = _mtp_spec(arch, config, spec, vp_stage) if config.mtp_num_layers else None
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch["vocab_size"] if vocab_size is None else vocab_size,
        max_sequence_length=arch_field(arch, "max_position_embeddings", 4096),
        pre_process=pre,
        post_process=post,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(arch.get("tie_word_embeddings", False)),
        rotary_percent=float(arch_field(arch, "rotary_fraction", 1.0)),
        rotary_base=_rotary_base(arch["rope_theta"]),
        vp_stage=vp_stage,
        mtp_block_spec=mtp,
        **rope,
    )


@beartype
def build_model_chunks(
    arch: Mapping[str, Any],
    config: Any,
    *,
    vocab_size: int | None = None,
    parallel_output: bool = True,
) -> list[Any]:
    """This rank's model chunks: ``vpp`` of them under virtual pipeline, else one."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages: Sequence[int | None] = [None] if vpp is None else range(vpp)
    return [
        build_gpt_model(
            arch, config, vp_stage=v, vocab_size=vocab_size, parallel_output=parallel_output
        )
        for v in stages
    ]


@beartype
def local_layer_offsets(config: Any) -> list[int]:
    """Global index of each chunk's first decoder layer on this rank.

    Parameter names hold local indices (``decoder.layers.0`` on every stage); global
    layer ``i`` of chunk ``c`` is ``offsets[c] + i``.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = config.virtual_pipeline_model_parallel_size
    stages: Sequence[int | None] = [None] if vpp is None else range(vpp)
    return [int(get_transformer_layer_offset(config, vp_stage=v)) for v in stages]
