"""Packed variable-length sequences as the Megatron engine feeds them: padded rows with a
block-diagonal causal mask.

:func:`~areal_fn.runtime.engines.packed.pack_rows` builds the rows (sequences
concatenated, per-position next-token targets of the same sequence, which count, their
weights; :func:`~areal_fn.plans.packing.pack_sequences` plans them). Here every row of
one call is padded on to the widest row's width, since the pipeline schedule sends
tensors of one shape (extra tokens: id 0, never counted), and gets its attention mask
``[1, 1, W, W]`` (``True`` = masked out): a token sees the earlier tokens of its own
sequence only; a sequence starts where ``position_ids`` restart at 0, and the padding
is a segment of its own.

Megatron-Core's local attention refuses ``PackedSeqParams`` (``thd``) on CPU, so packing
is this padded-row form; RoPE is relative, so the rotary positions may run on across
sequences.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Int
from torch import Tensor

from areal_fn.runtime.engines.packed import PackedRow, TokenSequence, pack_rows
from areal_fn.typecheck import beartype

__all__ = ["Rows", "packed_micro_batches", "segment_mask", "unpack_logprobs"]

#: A row's ``position_ids`` and its attention mask.
RowPositions = Int[Tensor, "width"]
RowMask = Bool[Tensor, "1 1 width width"]

#: Per micro-batch: ids, targets, which count, weights, attention mask (all ``[1, W]``
#: but the mask).
Rows = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


@beartype
def segment_mask(position_ids: RowPositions) -> RowMask:
    """``[1, 1, W, W]``, ``True`` = masked out: causal within the segments of a row
    ``[W]`` (a segment starts where ``position_ids`` is 0)."""
    segments = torch.cumsum(position_ids == 0, dim=0)
    width = segments.shape[0]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (~((segments[:, None] == segments[None, :]) & causal))[None, None]


def _widen(row: PackedRow, width: int) -> Rows:
    pad = width - row.input_ids.shape[1]
    ids, targets = F.pad(row.input_ids, (0, pad)), F.pad(row.targets, (0, pad))
    counted, weights = F.pad(row.counted, (0, pad)), F.pad(row.weights, (0, pad))
    positions = torch.cat([row.position_ids[0], torch.arange(pad)])
    return ids, targets, counted, weights, segment_mask(positions)


@beartype
def packed_micro_batches(
    sequences: list[TokenSequence], *, max_tokens: int, multiple_of: int
) -> tuple[list[Rows], tuple[PackedRow, ...]]:
    """One micro-batch per packed row, all of the widest row's width; and the rows."""
    rows = pack_rows(sequences, max_tokens=max_tokens, multiple_of=multiple_of)
    width = max(r.input_ids.shape[1] for r in rows)
    return [_widen(r, width) for r in rows], rows


@beartype
def unpack_logprobs(
    rows: Sequence[PackedRow], row_logprobs: Sequence[Tensor], lengths: Sequence[int]
) -> list[Tensor]:
    """Per sequence ``i``: ``log p(seq[t] | seq[:t])`` for ``t >= 1`` (``lengths[i] - 1``
    values), read from each row's per-position log-probs of its targets (``[1, W]``)."""
    out: dict[int, Tensor] = {}
    for row, logp in zip(rows, row_logprobs, strict=True):
        for i, start in zip(row.sequences, row.offsets, strict=True):
            out[i] = logp[0, start : start + lengths[i] - 1]
    return [out[i] for i in range(len(lengths))]
