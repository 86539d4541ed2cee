"""Megatron-Core decoder blocks of the gated-delta-net families (Qwen3-Next, Qwen3.5) from
local modules.

Megatron-Core 0.16 builds these models with
``get_transformer_block_with_experimental_attention_variant_spec``, which asserts
``transformer_impl == "transformer_engine"``. The block here is the same model from
the local spec (``get_gpt_decoder_layer_specs(use_transformer_engine=False)``, which
honours ``moe_layer_freq``), with three changes per layer:

- a linear-attention layer (``config.linear_attention_freq[i] == 1``) gets Megatron's
  own ``GatedDeltaNet`` in place of the attention, its ``in_proj`` a local
  ``ColumnParallelLinear`` (the input norm stays a layer norm of its own: the local
  spec fuses no norm into a linear), ``out_proj`` a ``RowParallelLinear`` and
  ``out_norm`` :class:`GatedOutputNorm`; on CPU its kernels are redirected to the
  module's own torch code (:mod:`~areal_fn.runtime.megatron.cpu`);
- every other norm (input, pre-MLP, q/k, final) is :class:`ZeroCentredRMSNorm`, the
  ``(1 + w)`` RMSNorm that ``layernorm_zero_centered_gamma`` asks for and that the
  local spec's torch norm refuses;
- full-attention layers keep the local ``SelfAttention``; ``attention_output_gate`` in
  the config makes it compute the sigmoid gate.

Megatron-Core decorates the output gate of both attentions (``_apply_output_gate``,
``GatedDeltaNet._apply_gated_norm``) with its ``jit_fuser``, which is ``torch.compile``:
on a CPU, inductor would compile them into C++ kernels (a compiler and its worker
threads, per shape). The block's modules (:func:`eager_modules`) compute the same
products eagerly.

``GatedOutputNorm`` keeps the checkpoint's plain weight (transformers' gated RMSNorm
multiplies by ``w``), so the conversion copies ``linear_attn.norm.weight`` as it is.
Transformer Engine's spec would make this norm zero-centred too (its values ``w - 1``),
which is why :func:`~areal_fn.layouts.megatron.megatron_layout` refuses ``naming="te"``
for these families.
"""

import copy
from typing import Any

import torch

from areal_fn.typecheck import beartype

__all__ = [
    "GatedOutputNorm",
    "ZeroCentredRMSNorm",
    "eager_modules",
    "gated_delta_block_spec",
]


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCentredRMSNorm(torch.nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, cast back to ``x``'s dtype; ``w`` starts at 0.
    Built as Megatron builds its norms (``config``, ``hidden_size``, ``eps``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype, device=torch.cuda.current_device())
        )
        # replicated over TP; Megatron's gradient all-reduce of sequence-parallel norms
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalise(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedOutputNorm(torch.nn.Module):
    """``GatedDeltaNet``'s ``out_norm``: ``w * (x / rms(x))``, the normalised value cast to
    ``x``'s dtype before the weight (transformers' gated RMSNorm; the gate is applied by
    ``GatedDeltaNet`` after it); ``w`` starts at 1.

    ``w`` is replicated over TP, but each TP rank normalises the value heads of its own
    key heads, so each rank's gradient of ``w`` is a part of the whole. The weight enters
    the product through Megatron's ``copy_to_tensor_model_parallel_region`` (identity
    forward, all-reduce over TP backward), so every rank gets the sum. (Megatron-Core's own
    norm there gets its TP all-reduce only under sequence parallelism, through the
    ``sequence_parallel`` attribute; this weight does not carry it, so it is summed once.)
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=torch.cuda.current_device())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = self.weight
        if self.config.tensor_model_parallel_size > 1:
            weight = copy_to_tensor_model_parallel_region(weight)
        return weight * _normalise(x, self.eps).to(x.dtype)


def eager_modules() -> tuple[type, type]:
    """Megatron-Core's ``SelfAttention`` and ``GatedDeltaNet`` with their output gates
    computed eagerly: ``x * sigmoid(gate)`` and ``out_norm(x) * act(gate)``, in float32
    and cast back to ``x``'s dtype, as Megatron's compiled functions compute them."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    class GatedSelfAttention(SelfAttention):  # type: ignore[misc]
        def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            gate = gate.contiguous().view(*x.shape)
            return (x * torch.sigmoid(gate.float())).to(x.dtype)

    class EagerGatedDeltaNet(GatedDeltaNet):  # type: ignore[misc]
        def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            y = self.out_norm(x.reshape(-1, x.shape[-1]))
            y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
            return y.to(x.dtype)

    return GatedSelfAttention, EagerGatedDeltaNet


def _layer_ids(config: Any, vp_stage: int | None) -> list[int]:
    """The global decoder layers this pipeline chunk builds (as Megatron's block specs)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))


@beartype
def gated_delta_block_spec(config: Any, *, vp_stage: int | None = None) -> Any:
    """This chunk's ``TransformerBlockSubmodules``: gated-delta-net and gated full-attention
    layers as ``config.linear_attention_freq`` says, dense or MoE MLPs as
    ``config.moe_layer_freq`` says, every norm zero-centred but the linear layers'
    output norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    attention, delta_net = eager_modules()
    linear = list(config.linear_attention_freq)
    gdn = ModuleSpec(
        module=delta_net,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm, out_proj=RowParallelLinear
        ),
    )
    layers = []
    for i, base in enumerate(get_gpt_decoder_layer_specs(config, False, normalization="RMSNorm")):
        layer = copy.deepcopy(base)  # the list repeats one spec object per kind
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCentredRMSNorm
        if linear[i]:
            sub.self_attention = gdn
        else:
            sub.self_attention.module = attention
            attn = sub.self_attention.submodules
            attn.q_layernorm = attn.k_layernorm = ZeroCentredRMSNorm
        layers.append(layer)
    return TransformerBlockSubmodules(
        layer_specs=[layers[i] for i in _layer_ids(config, vp_stage)],
        layer_norm=ZeroCentredRMSNorm,
    )
