"""Packed rows through gated-delta-net linear attention: every sequence on its own.

transformers' linear-attention module (Qwen3-Next, Qwen3.5) runs its causal conv and
its delta rule along the whole row it is given, so in a packed row a sequence would
start from the conv window and recurrent state the previous sequence left. Attention
layers need no such care (the engines' attention function masks by ``position_ids``);
a linear-attention layer does. :func:`install` wraps each linear-attention module of a
model (:func:`~areal_fn.model.linear_attention.linear_mixers` names them):

1. a forward pre-hook on its decoder layer reads the layer's ``position_ids`` and keeps
   each row's sequences: a sequence starts at column 0 and wherever ``position_ids``
   is 0 (:func:`sequence_spans`, read once for the tensor every layer of a forward gets);
2. the module's ``forward`` then runs transformers' own forward on each sequence's
   slice alone (a fresh state and conv window for each) and concatenates the outputs
   along the row; a batch whose every row holds one sequence runs whole, as before.

The pre-hook runs again when activation checkpointing recomputes the layer, with the
same ``position_ids``. With a cache or a padding mask (generation) a packed row is
refused: the engines pass neither.
"""

from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn

from areal_fn.errors import LayoutError
from areal_fn.model.linear_attention import linear_mixers
from areal_fn.model.spec import ModelSpec
from areal_fn.typecheck import beartype

__all__ = ["install", "sequence_spans"]

Spans = tuple[tuple[tuple[int, int], ...], ...]


def sequence_spans(position_ids: Tensor | None) -> Spans | None:
    """Per row of ``position_ids`` ``[b, T]``, the ``(start, end)`` column range of each
    sequence (one starts at column 0 and wherever the position is 0); ``None`` when no
    row holds more than one sequence (or without ``position_ids``)."""
    if position_ids is None:
        return None
    if position_ids.ndim != 2:
        raise LayoutError(
            f"position_ids of shape {tuple(position_ids.shape)} reached a linear-attention "
            "layer; packed rows need [batch, tokens] position_ids"
        )
    starts = position_ids == 0
    starts[:, :1] = True
    width = position_ids.shape[1]
    out = []
    for row in starts.cpu():
        cuts = [int(i) for i in row.nonzero().flatten()] + [width]
        out.append(tuple(pairwise(cuts)))
    if all(len(row) == 1 for row in out):
        return None
    return tuple(out)


class _LastSpans:
    """The spans of the last ``position_ids`` tensor a model's layers were given (every
    layer of one forward gets the same tensor: its spans are read once)."""

    def __init__(self) -> None:
        self.ids: Tensor | None = None
        self.spans: Spans | None = None

    def of(self, position_ids: Tensor | None) -> Spans | None:
        if position_ids is None or position_ids is not self.ids:
            self.ids, self.spans = position_ids, sequence_spans(position_ids)
        return self.spans


class _PerSequence:
    """One linear-attention module's forward, run per sequence of a packed row."""

    def __init__(self, inner: Any, name: str, last: _LastSpans) -> None:
        self.inner = inner
        self.name = name
        self.last = last
        self.spans: Spans | None = None

    def record(self, _layer: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.spans = self.last.of(kwargs.get("position_ids"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spans = self.spans
        if spans is None:
            return self.inner(*args, **kwargs)
        hidden: Tensor = args[0] if args else kwargs.pop("hidden_states")
        rest = args[1:]
        given = [k for k in ("cache", "attention_mask") if kwargs.get(k) is not None]
        given += ["a positional argument"] * any(a is not None for a in rest)
        if given:
            raise LayoutError(
                f"{self.name}: a packed row (several sequences, position_ids restarting at "
                f"0) given {' and '.join(given)}; packed rows run without a cache or padding "
                "mask (use_cache=False, no attention_mask), or one sequence per row"
            )
        if hidden.shape[0] != len(spans) or hidden.shape[1] != spans[0][-1][1]:
            raise LayoutError(
                f"{self.name}: hidden states of shape {tuple(hidden.shape)} but position_ids "
                f"of {len(spans)} rows of {spans[0][-1][1]} tokens"
            )
        rows = [
            torch.cat([self.inner(hidden[b : b + 1, s:e], **kwargs) for s, e in row], dim=1)
            for b, row in enumerate(spans)
        ]
        return torch.cat(rows, dim=0)


@beartype
def install(model: nn.Module, spec: ModelSpec) -> int:
    """Wrap every linear-attention module of ``model`` (``spec``'s transformers model) to
    run each sequence of a packed row alone; returns how many were wrapped (0 without
    linear attention). Call it once, before FSDP2 or activation checkpointing wrap the
    layers."""
    mixers = linear_mixers(spec)
    last = _LastSpans()
    for layer_name, name in mixers:
        layer, module = model.get_submodule(layer_name), model.get_submodule(name)
        if isinstance(vars(module).get("forward"), _PerSequence):
            raise LayoutError(f"{name}: linear_packed.install was already called on this model")
        wrapper = _PerSequence(module.forward, name, last)
        layer.register_forward_pre_hook(wrapper.record, with_kwargs=True)
        module.forward = wrapper  # type: ignore[method-assign]
    return len(mixers)
