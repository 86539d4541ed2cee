"""Layout computation at scale: Qwen3-235B-A22B under a 256-rank Megatron strategy.

Prints the time to build the layout, to compute one rank's local tensors and pieces,
and all 256 ranks (with the ratio all/one: far below 256 thanks to the presence index
and the per-(shape, sharding, rank) geometry cache). Process CPU time, one core.
"""

import time
from pathlib import Path

from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.pipeline.partition import split_evenly
from areal_fn.strategy.allocation import ParallelDims

SPECS = Path(__file__).resolve().parents[1] / "specs" / "models"


def run() -> None:
    model = model_from_hf_config(SPECS / "Qwen3-235B-A22B.json")
    dims = ParallelDims(dp=8, pp=8, tp=4, ep=32)
    stages = split_evenly([1.0] * model.num_layers, dims.pp)
    _ = model.tensors  # canonical tensor list built once (cached on the spec)
    t0 = time.process_time()
    layout = megatron_layout(model, dims, stages=stages)
    t_build = time.process_time() - t0
    t0 = time.process_time()
    one = layout.local_tensors(0)
    t_one = time.process_time() - t0
    t0 = time.process_time()
    pieces = 0
    for r in range(layout.world_size):
        pieces += sum(len(lt.pieces) for lt in layout.local_tensors(r))
    t_all = time.process_time() - t0
    print(
        f"Qwen3-235B-A22B, megatron {dims} ({layout.world_size} ranks, {len(layout.tensors)} logical tensors)"
    )
    print(f"  build layout          {t_build * 1e3:9.1f} ms")
    print(f"  one rank (rank 0)     {t_one * 1e3:9.1f} ms  ({len(one)} local tensors)")
    print(
        f"  all {layout.world_size} ranks         {t_all * 1e3:9.1f} ms  ({pieces} pieces; {t_all / max(t_one, 1e-9):.0f}x one rank, not {layout.world_size}x)"
    )


if __name__ == "__main__":
    run()
