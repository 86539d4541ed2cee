"""Weight sync of gpt-oss under Megatron-Core, whose experts are strided pieces.

``linear_fc1`` of an expert is ``gate_up_proj[e]`` de-interleaved and transposed; the
plan is made in the lifted basis and the executor indexes views of the tensors
(:mod:`areal_fn.layouts.lift`). In-process members (threads over one ``HashStore``,
as in ``test_weight_sync.py``): a Megatron trainer to SGLang-style TP engines and
back, each rank with its whole plan or its own rows. The oracle is the conversion
(``to_megatron`` of the new canonical weights on each destination rank), not the plan;
live tensors are written in place (same storage before and after).
"""

from typing import Any

import pytest
import torch
import torch.distributed as dist

from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.plans.transfer import bucket, plan_rank_transfers, plan_transfers
from areal_fn.runtime.sync.executor import SyncGroup, SyncReport, send_and_receive
from areal_fn.strategy.allocation import ParallelDims
from tests.distributed.test_weight_sync import run_ranks, same

CONFIG = {
    "model_type": "gpt_oss",
    "hidden_size": 16,
    "intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "vocab_size": 40,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "torch_dtype": "float32",
}
GPT_OSS = model_from_hf_config(CONFIG)
#: experts of 256 x 512 fp32 (512 KiB): boxes that big travel as operations of their own
LARGE = model_from_hf_config({**CONFIG, "hidden_size": 256, "intermediate_size": 256})


def canonical(model: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}


def tensors(layout: Layout, ranks: tuple[int, ...], rank: int, values) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return to_megatron(values, layout, ranks.index(rank)) if rank in ranks else {}


@pytest.mark.parametrize(
    ("direction", "own_rows", "large"),
    [
        ("to_inference", False, False),
        ("to_inference", True, False),
        ("to_megatron", False, False),
        ("to_inference", False, True),
        ("to_megatron", False, True),
    ],
)
def test_gpt_oss_megatron_experts_sync_through_views(
    direction: str, own_rows: bool, large: bool
) -> None:
    model = LARGE if large else GPT_OSS
    megatron = megatron_layout(model, ParallelDims(dp=2, ep=2, pp=2))
    engine = inference_layout(model, ParallelDims(tp=2))
    if direction == "to_inference":
        src, dst, sr, dr = megatron, engine, (0, 1, 2, 3), (4, 5)
    else:
        src, dst, sr, dr = engine, megatron, (4, 5), (0, 1, 2, 3)
    world = 6
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    assert plan.lifted and (plan.src_views if direction == "to_inference" else plan.dst_views)
    plans = {
        r: bucket(
            plan_rank_transfers(src, dst, r, src_ranks=sr, dst_ranks=dr) if own_rows else plan,
            64 << 20 if large else 2048,
            version=1,
        )
        for r in range(world)
    }
    old, new = canonical(model, 1), canonical(model, 2)
    lives = [tensors(dst, dr, r, old) for r in range(world)]
    storage = [{n: t.data_ptr() for n, t in live.items()} for live in lives]

    def body(rank: int, store: dist.Store) -> Any:
        group = SyncGroup.from_store(store, members=range(world), rank=rank, timeout_s=20)
        return send_and_receive(
            plans[rank],
            src_tensors=tensors(src, sr, rank, new),
            dst_tensors=lives[rank],
            group=group,
        )

    results = run_ranks(world, body)
    assert all(isinstance(r, SyncReport) for r in results), results
    for rank in dr:
        assert same(lives[rank], tensors(dst, dr, rank, new)), rank
        assert {n: t.data_ptr() for n, t in lives[rank].items()} == storage[rank]
        assert results[rank].bytes_received == plan.recv_bytes()[rank]
    assert any("linear_fc1" in t.src_tensor + t.dst_tensor for t in plan.transfers)
