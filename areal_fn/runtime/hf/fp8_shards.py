"""Ranks quantising their shards of a weight to block FP8 together (torch.distributed).

:func:`quantize_shard` runs one rank's part of a
:class:`~areal_fn.plans.fp8.Fp8ShardPlan`: the partial amax of every block its box
touches, one all-reduce ``MAX`` over the plan's cut blocks (every rank of the group takes
part, a block it does not hold counting 0: the result is the maximum over the block's
holders), then the rank's FP8 values and scales computed alone: bitwise the slice of
the whole tensor's quantisation.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from areal_fn.plans.fp8 import Fp8ShardPlan, block_amax, quantize_fp8

__all__ = ["quantize_shard"]


def quantize_shard(
    x: Tensor,
    plan: Fp8ShardPlan,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    name: str = "tensor",
) -> tuple[Tensor, Tensor]:
    """``rank``'s FP8 values and scales (over :meth:`Fp8ShardPlan.scale_box`) of its box
    ``x`` of the plan's weight. Collective over ``group`` (every rank of the plan calls
    it, in the same order for several weights); ``rank`` is the rank's index in the plan."""
    box = plan.boxes[rank]
    grid = plan.scale_box(rank)
    amax = block_amax(x, block=plan.block, origin=(box.start[0], box.start[1]))
    cut = plan.cut_blocks
    if cut:
        shared = torch.zeros(len(cut), dtype=torch.float32)
        where = {index: i for i, index in enumerate(cut)}
        (g0, _), (h0, _) = grid.ranges
        mine = [(u.index, where[u.index]) for u in plan.uses[rank] if u.cut]
        for (i, j), k in mine:
            shared[k] = amax[i - g0, j - h0]
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
        for (i, j), k in mine:
            amax[i - g0, j - h0] = shared[k]
    return quantize_fp8(x, amax, block=plan.block, origin=(box.start[0], box.start[1]), name=name)
