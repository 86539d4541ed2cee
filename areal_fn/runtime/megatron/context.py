"""Context parallelism in Megatron-Core without Transformer Engine: a core attention of ours.

Megatron-Core 0.16's local ``DotProductAttention`` refuses ``context_parallel_size > 1``
("Context parallelism is only supported by TEDotProductAttention!"). The rest of
Megatron-Core is CP-aware: the rotary embedding is computed for ``T`` positions and
sliced per rank (:mod:`~areal_fn.runtime.megatron.cpu` redirects that slicing on CPU),
pipeline tensors carry ``T / cp`` tokens, DDP reduces gradients over ``dp x cp`` and
``finalize_model_grads`` all-reduces token counts over ``dp x cp``.

:func:`context_parallel_attention` is the class :func:`~areal_fn.runtime.megatron.build.layer_spec`
puts at ``self_attention.submodules.core_attention`` when ``cp > 1`` (without Transformer
Engine): it takes ``DotProductAttention``'s constructor arguments (and the ``k_channels``
/ ``v_channels`` multi-latent attention passes) and, per layer,

1. all-gathers K and V over the context-parallel group (``pg_collection.cp``; the
   backward reduce-scatters their gradients) and puts the chunks back in sequence
   order (:func:`~areal_fn.plans.context.context_gather_order`);
2. takes the rows of this rank's queries from the ``[b or 1, 1, T, T]`` attention mask
   (``True`` = masked out; a block-diagonal causal mask for packed rows), or builds
   the causal mask from the global positions when the mask is ``None``;
3. computes softmax attention in fp32 over all ``T`` keys.

Each rank holds the tokens of chunks ``r`` and ``2 cp - 1 - r``
(:func:`~areal_fn.plans.context.context_chunks`): :func:`split_for_cp` cuts a full row
so, :func:`gather_from_cp` all-gathers per-token results and restores sequence order.
"""

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from areal_fn.errors import LayoutError
from areal_fn.plans.context import context_chunks, context_gather_order
from areal_fn.typecheck import beartype

__all__ = ["context_parallel_attention", "cp_positions", "gather_from_cp", "split_for_cp"]


@beartype
def cp_positions(seq_len: int, cp: int, rank: int, device: torch.device) -> Tensor:
    """The global positions (``int64``) of the tokens context-parallel ``rank`` holds."""
    return torch.cat(
        [
            torch.arange(lo, hi, device=device)
            for lo, hi in context_chunks(seq_len, cp=cp, rank=rank)
        ]
    )


def _cp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
        ps.get_context_parallel_group(),
    )


@beartype
def split_for_cp(x: Tensor, *, dim: int = 1) -> Tensor:
    """This context-parallel rank's tokens of ``x`` (full rows along ``dim``)."""
    cp, rank, _ = _cp()
    if cp == 1:
        return x
    return x.index_select(dim, cp_positions(x.shape[dim], cp, rank, x.device))


def _in_sequence_order(gathered: Tensor, cp: int, dim: int) -> Tensor:
    chunks = gathered.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in context_gather_order(cp)], dim=dim)


@beartype
def gather_from_cp(x: Tensor, *, dim: int = 1) -> Tensor:
    """All-gather per-token values over the context-parallel group (no gradient) and
    restore sequence order along ``dim``."""
    cp, _, group = _cp()
    if cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return _in_sequence_order(torch.cat(parts, dim=dim), cp, dim)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward reduce-scatters (sums)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        n = dist.get_world_size(ctx.group)
        parts = [p.contiguous() for p in grad.chunk(n, dim=0)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


def _refuse(config: Any, attention_dropout: float | None) -> None:
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    unsupported = {
        "attention_dropout": dropout,
        "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
        "window_size": config.window_size,
        "softmax_type": None if config.softmax_type == "vanilla" else config.softmax_type,
    }
    bad = {k: v for k, v in unsupported.items() if v}
    if bad:
        raise LayoutError(
            f"context-parallel core attention (cp={config.context_parallel_size}) computes "
            f"plain causal softmax attention; the config asks for {bad}; use cp=1 or "
            "Transformer Engine's attention for these"
        )


@functools.cache
def context_parallel_attention() -> type:
    """The core-attention class for ``cp > 1`` (built on first use: Megatron imports)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import MegatronModule

    class ContextParallelAttention(MegatronModule):  # type: ignore[misc]
        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
            k_channels: Any = None,
            v_channels: Any = None,
        ) -> None:
            super().__init__(config=config)
            _refuse(config, attention_dropout)
            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                    required_pgs=["tp", "cp"]
                )
            self.cp_group = pg_collection.cp
            self.softmax_scale = (
                1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
            )

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> Tensor:
            if packed_seq_params is not None or attention_bias is not None:
                raise LayoutError(
                    "the context-parallel core attention takes padded rows with a "
                    "[b, 1, T, T] attention mask, not packed_seq_params or an attention bias"
                )
            return _attend(self, query, key, value, attention_mask)

    return ContextParallelAttention


def _attend(
    module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None
) -> Tensor:
    # query [sq, b, nq, dk]; key [sq, b, ng, dk]; value [sq, b, ng, dv]; sq = T / cp
    cp, rank = module.cp_group.size(), module.cp_group.rank()
    key = _in_sequence_order(_GatherTokens.apply(key, module.cp_group), cp, 0)
    value = _in_sequence_order(_GatherTokens.apply(value, module.cp_group), cp, 0)
    seq, (sq, b, nq, _) = key.shape[0], query.shape
    rows = cp_positions(seq, cp, rank, query.device)
    if attention_mask is None:
        mask = rows[:, None] < torch.arange(seq, device=query.device)[None, :]
    else:
        mask = attention_mask.index_select(2, rows)
    if nq > key.shape[2]:  # query groups: each query head keeps its own KV head
        key = key.repeat_interleave(nq // key.shape[2], dim=2)
        value = value.repeat_interleave(nq // value.shape[2], dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * module.softmax_scale
    scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    context = torch.matmul(probs, v)  # [b, n, sq, dv]
    return context.permute(2, 0, 1, 3).reshape(sq, b, nq * v.shape[-1])
