"""Packed variable-length sequences: the engine input type and the rows built from it.

A micro-batch of RL rollouts is a list of :class:`TokenSequence` of different lengths.
:func:`pack_rows` deals them into rows by :func:`~areal_fn.plans.packing.pack_sequences`
(at most ``max_tokens`` tokens a row, rows padded to a multiple of ``multiple_of``):
each row concatenates its sequences, ``position_ids`` restart at 0 for each sequence
(so attention stays inside it), and every token's target is the next token *of its
sequence*: the last token of a sequence and every padding token have no target.

Per-token ``weights`` (an RL loss's advantages or importance weights) scale each
target's cross entropy; the loss is still divided by the number of targets. Padding
tokens are id 0 at positions ``0, 1, ...`` (a segment of their own) and never count.
"""

import attrs
import torch
from torch import Tensor

from areal_fn.errors import SpecError
from areal_fn.plans.packing import pack_sequences, padded_row_length
from areal_fn.typecheck import beartype

__all__ = ["PackedRow", "TokenSequence", "full_row_targets", "pack_rows"]


def _check_sequence(inst: "TokenSequence") -> None:
    ids = inst.input_ids
    if ids.ndim != 1 or ids.dtype not in (torch.int64, torch.int32) or ids.numel() < 2:
        raise SpecError(
            f"TokenSequence.input_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}; "
            "give a 1-D integer tensor of at least 2 tokens"
        )
    for name, value, dtypes in (
        ("loss_mask", inst.loss_mask, (torch.bool,)),
        ("weights", inst.weights, (torch.float32, torch.float64)),
    ):
        if value is not None and (value.shape != ids.shape or value.dtype not in dtypes):
            raise SpecError(
                f"TokenSequence.{name} has shape {tuple(value.shape)} and dtype {value.dtype}; "
                f"it needs input_ids' shape {tuple(ids.shape)} and a dtype in {dtypes}"
            )


@attrs.frozen(kw_only=True, eq=False)
class TokenSequence:
    """One sequence: ``input_ids`` ``[n]``; ``loss_mask[t]`` says whether token ``t``
    (``t >= 1``) is a target (default: all); ``weights[t]`` scales its loss (default 1)."""

    input_ids: Tensor
    loss_mask: Tensor | None = None
    weights: Tensor | None = None

    def __attrs_post_init__(self) -> None:
        _check_sequence(self)

    def __len__(self) -> int:
        return int(self.input_ids.numel())


@attrs.frozen(kw_only=True, eq=False)
class PackedRow:
    """One packed row ``[1, L]``: ids, positions, next-token targets, which targets count
    (``counted``) and their loss weights (0 where not counted); ``sequences`` are the
    indices of the packed sequences and ``offsets`` where each starts in the row."""

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    counted: Tensor
    weights: Tensor
    sequences: tuple[int, ...]
    offsets: tuple[int, ...]


def _targets(seq: TokenSequence) -> tuple[Tensor, Tensor, Tensor]:
    ids = seq.input_ids.long()
    targets = torch.roll(ids, -1)
    counted = torch.ones_like(ids, dtype=torch.bool) if seq.loss_mask is None else seq.loss_mask
    counted = torch.roll(counted, -1).clone()
    counted[-1] = False  # a sequence's last token predicts nothing
    w = torch.ones(ids.shape, dtype=torch.float64) if seq.weights is None else seq.weights
    return targets, counted, torch.roll(w.double(), -1) * counted


@beartype
def pack_rows(
    sequences: list[TokenSequence], *, max_tokens: int, multiple_of: int = 1
) -> tuple[PackedRow, ...]:
    """The rows :func:`~areal_fn.plans.packing.pack_sequences` plans, as tensors."""
    lengths = [len(s) for s in sequences]
    out = []
    for row in pack_sequences(lengths, max_tokens, multiple_of=multiple_of):
        width = padded_row_length(lengths, row, multiple_of=multiple_of)
        pad = width - sum(lengths[i] for i in row)
        parts = [_targets(sequences[i]) for i in row]
        ids = [sequences[i].input_ids.long() for i in row] + [torch.zeros(pad, dtype=torch.long)]
        pos = [torch.arange(n) for n in [lengths[i] for i in row] + [pad]]
        zeros = torch.zeros(pad, dtype=torch.bool)
        offsets = tuple(sum(lengths[j] for j in row[:k]) for k in range(len(row)))
        out.append(
            PackedRow(
                input_ids=torch.cat(ids).unsqueeze(0),
                position_ids=torch.cat(pos).unsqueeze(0),
                targets=torch.cat([p[0] for p in parts] + [zeros.long()]).unsqueeze(0),
                counted=torch.cat([p[1] for p in parts] + [zeros]).unsqueeze(0),
                weights=torch.cat([p[2] for p in parts] + [zeros.double()]).unsqueeze(0).float(),
                sequences=row,
                offsets=offsets,
            )
        )
    return tuple(out)


def full_row_targets(input_ids: Tensor, loss_mask: Tensor | None) -> PackedRow:
    """Padded rows ``[b, T]`` as one :class:`PackedRow`: each row one sequence, targets
    on the full row (``roll(ids, -1)``, last column not counted)."""
    b, t = input_ids.shape
    targets = torch.roll(input_ids, -1, dims=1)
    counted = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask
    counted = torch.roll(counted, -1, dims=1).clone()
    counted[:, -1] = False
    return PackedRow(
        input_ids=input_ids,
        position_ids=torch.arange(t).expand(b, t),
        targets=targets,
        counted=counted,
        weights=counted.float(),
        sequences=tuple(range(b)),
        offsets=(0,) * b,
    )
