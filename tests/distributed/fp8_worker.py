"""One torchrun launch (4 ranks, gloo): ranks quantise their shards of weights to block FP8
by the plan (``quantize_shard``); rank 0 records whether every rank's values and scales
equal the whole tensor's quantisation, bitwise. Run by ``test_fp8_shards.py``."""

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.distributed as dist

from areal_fn.plans.fp8 import block_amax, plan_fp8_shards, quantize_fp8
from areal_fn.runtime.hf.fp8_shards import quantize_shard
from areal_fn.sharding.box import Box

#: (shape, block, row cuts, column cuts): a 2x2 grid of boxes, ranks in row-major order
CASES = [
    ((40, 56), (16, 16), (0, 21, 40), (0, 30, 56)),  # both cuts inside blocks
    ((576, 256), (128, 128), (0, 192, 576), (0, 128, 256)),  # kv_a_proj's 576 rows by 3
    ((64, 64), (16, 16), (0, 32, 64), (0, 32, 64)),  # aligned: nothing exchanged
    ((33, 17), (8, 8), (0, 1, 33), (0, 16, 17)),
]


def _boxes(rows: tuple[int, ...], cols: tuple[int, ...]) -> list[Box]:
    return [
        Box(ranges=((r0, r1), (c0, c1)))
        for r0, r1 in itertools.pairwise(rows)
        for c0, c1 in itertools.pairwise(cols)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = []
    try:
        for i, (shape, block, rows, cols) in enumerate(CASES):
            x = (torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 3).bfloat16()
            boxes = _boxes(rows, cols)
            plan = plan_fp8_shards(shape, boxes, block=block)
            q, s = quantize_shard(x[boxes[rank].slices()], plan, rank)
            gathered: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (q.view(torch.uint8), s))
            if rank == 0:
                wq, ws = quantize_fp8(x, block_amax(x, block=block), block=block)
                same = [
                    torch.equal(gq, wq[boxes[r].slices()].view(torch.uint8))
                    and torch.equal(gs, ws[plan.scale_box(r).slices()])
                    for r, (gq, gs) in enumerate(gathered)  # type: ignore[misc]
                ]
                record.append({"case": i, "cut": len(plan.cut_blocks), "same": same})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
