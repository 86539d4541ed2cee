"""Ulysses sequence parallelism for transformers models: an attention function of ours.

Each rank of a sequence-parallel (``sp``) group holds ``T/sp`` consecutive tokens of
the same rows. Everything but attention is per token, so it runs on the slice as is;
attention is registered with transformers' ``AttentionInterface`` under
:data:`ATTENTION` and, in every decoder layer:

1. all-to-all over the ``sp`` group turns q/k/v from ``[b, heads, T/sp, d]`` (all
   heads of this rank's tokens) into ``[b, heads/sp, T, d]`` (all tokens of
   ``heads/sp`` heads); KV heads fewer than ``sp`` are first repeated with
   ``repeat_interleave(sp // kv)``, so that every query head keeps its own KV head;
2. causal attention over all ``T`` tokens, restricted to each sequence: the
   ``position_ids`` of the whole row (all-gathered) restart at 0 where a packed
   sequence starts, and a token attends only to earlier tokens of its own sequence;
3. all-to-all back to ``[b, heads, T/sp, d]``.

Sliding windows and attention sinks (gpt-oss) are applied as transformers' eager
attention applies them; each rank adds the sinks of the heads it runs.

The all-to-alls carry gradients (their backward is the inverse all-to-all). With
``sp = 1`` there is no communication and this is eager attention with a
block-diagonal causal mask built from ``position_ids``. :func:`install` selects the
function for a model and gives its attention modules their group.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from areal_fn.errors import LayoutError
from areal_fn.typecheck import beartype

__all__ = ["ATTENTION", "all_to_all", "install", "segment_mask", "ulysses_attention"]

#: The ``attn_implementation`` name of :func:`ulysses_attention`.
ATTENTION = "areal_ulysses"
_GROUP = "_areal_sp_group"


def _exchange(x: Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> Tensor:
    sp = dist.get_world_size(group)
    send = torch.stack(x.chunk(sp, dim=scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, group: dist.ProcessGroup, scatter: int, gather: int
    ) -> Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return _exchange(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def all_to_all(x: Tensor, group: dist.ProcessGroup, *, scatter: int, gather: int) -> Tensor:
    """Split dim ``scatter`` over the group's ranks, concatenate what arrives along
    ``gather`` (in rank order); differentiable."""
    out: Tensor = _AllToAll.apply(x, group, scatter, gather)
    return out


def segment_mask(position_ids: Tensor) -> Tensor:
    """``[b, T, T]`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` and no
    position 0 (a sequence start) lies in ``(j, i]``."""
    seg = (position_ids == 0).cumsum(dim=-1)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal


def _gather_positions(position_ids: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    if group is None:
        return position_ids
    parts = [torch.empty_like(position_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention-interface function: ``[b, h, T/sp, d]`` in, ``[b, T/sp, h, dv]`` out.

    ``sliding_window`` (gpt-oss's sliding layers): query ``i`` attends keys ``j > i -
    window`` only, as transformers' mask. ``s_aux`` (gpt-oss's attention sinks, one logit
    per head of the module): an extra softmax column per head, dropped after the softmax;
    under Ulysses each rank takes the sinks of the heads it runs.
    """
    if _GROUP not in vars(module):
        raise LayoutError(
            f"{type(module).__name__} has no sequence-parallel group; call ulysses.install(model, group)"
        )
    group: dist.ProcessGroup | None = vars(module)[_GROUP]
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise LayoutError(
            "Ulysses attention needs position_ids (the model passes them to attention)"
        )
    sp_group = group if group is not None and dist.get_world_size(group) > 1 else None
    if sp_group is not None:
        sp, kv = dist.get_world_size(sp_group), key.shape[1]
        if kv < sp:  # each of sp ranks needs one KV head: repeat, keeping the head order
            key = key.repeat_interleave(sp // kv, dim=1)
            value = value.repeat_interleave(sp // kv, dim=1)
        query, key, value = (
            all_to_all(x, sp_group, scatter=1, gather=2) for x in (query, key, value)
        )
    allowed = segment_mask(_gather_positions(position_ids, sp_group))
    window = kwargs.get("sliding_window")
    if window is not None:
        t = allowed.shape[-1]
        idx = torch.arange(t, device=allowed.device)
        allowed = allowed & (idx.unsqueeze(-1) - idx.unsqueeze(0) < int(window))
    allowed = allowed.unsqueeze(1)
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        if sp_group is not None:
            sinks = sinks.chunk(dist.get_world_size(sp_group))[dist.get_rank(sp_group)]
        b, h, t = scores.shape[:3]
        column = sinks.reshape(1, h, 1, 1).expand(b, h, t, 1).to(scores.dtype)
        scores = torch.cat([scores, column], dim=-1)
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)
    if sp_group is not None:
        out = all_to_all(out, sp_group, scatter=2, gather=1)
    return out.transpose(1, 2).contiguous(), None


@beartype
def install(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Select :func:`ulysses_attention` for ``model`` and give every decoder layer's
    ``self_attn`` the sequence-parallel ``group`` (``None``: no sequence parallelism);
    a linear-attention layer (``linear_attn``, no ``self_attn``) has no softmax attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    layers = model.get_submodule("model.layers")
    if not isinstance(layers, nn.ModuleList):
        raise LayoutError(f"model.layers is a {type(layers).__name__}, not the decoder layers")
    for layer in layers:
        if isinstance(attn := getattr(layer, "self_attn", None), nn.Module):
            vars(attn)[_GROUP] = group
    model.config._attn_implementation = ATTENTION  # type: ignore[union-attr]
