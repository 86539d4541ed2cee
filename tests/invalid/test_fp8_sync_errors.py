"""What a weight sync into an FP8 deployment refuses, with the reason: a rank holding two
pieces of one weight (Megatron's linear_qkv with two KV groups per rank), layouts with
strided pieces, ``wire_dtype``, and destination live tensors that are not FP8 (every
member of the sync fails with the reason; no live tensor changes)."""

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from areal_fn.errors import LayoutError, PlanError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.quantized import Fp8Format
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.fp8_sync import fp8_layout, fp8_quantization
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.runtime.engines.fsdp2_apply import materialize_local
from areal_fn.runtime.sync.executor import SyncError, SyncGroup
from areal_fn.runtime.sync.fp8 import send_and_receive_fp8
from areal_fn.strategy.allocation import ParallelDims
from tests.laws.test_strided_pieces import TINY_GPT_OSS


def spec(kv_heads: int) -> Any:
    return model_from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": kv_heads,
            "vocab_size": 72,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    )


def test_two_pieces_of_a_weight_on_one_rank_are_refused() -> None:
    layout = megatron_layout(spec(4), ParallelDims(tp=2))  # two KV groups per rank
    with pytest.raises(LayoutError, match=r"rank 0 holds two pieces of 'model.layers.0.self_attn"):
        fp8_layout(layout, Fp8Format())
    with pytest.raises(LayoutError, match="one piece of a weight per rank"):
        fp8_quantization(layout, Fp8Format())


def test_strided_layouts_are_refused() -> None:
    layout = megatron_layout(model_from_hf_config(TINY_GPT_OSS), ParallelDims(tp=2))
    with pytest.raises(LayoutError, match="strided pieces"):
        fp8_layout(layout, Fp8Format())


def test_wire_dtype_is_refused() -> None:
    group = SyncGroup.from_store(dist.HashStore(), members=range(1), rank=0, timeout_s=5)
    layout = fsdp2_layout(spec(2), ParallelDims())
    plan = bucket(plan_transfers(layout, layout), 1 << 20, version=1)
    with pytest.raises(PlanError, match=r"wire_dtype=torch\.bfloat16: an FP8 sync sends"):
        send_and_receive_fp8(
            plan,
            quantization=(),
            src_rank=0,
            src_tensors={},
            dst_tensors={},
            group=group,
            wire_dtype=torch.bfloat16,
        )


def test_a_destination_that_is_not_fp8_fails_every_member() -> None:
    s, fmt = spec(2), Fp8Format()
    train, infer = fsdp2_layout(s, ParallelDims()), inference_layout(s, ParallelDims())
    plan = bucket(
        plan_transfers(
            fp8_layout(train, fmt), fp8_layout(infer, fmt), src_ranks=(0,), dst_ranks=(1,)
        ),
        1 << 20,
        version=1,
    )
    values = {c.name: torch.randn(c.shape).bfloat16() for c in s.tensors}
    live = {lt.name: torch.zeros(lt.shape, dtype=torch.bfloat16) for lt in infer.local_tensors(0)}
    store = dist.HashStore()
    out: list[Exception | None] = [None, None]

    def body(rank: int) -> None:
        try:
            group = SyncGroup.from_store(store, members=range(2), rank=rank, timeout_s=10)
            send_and_receive_fp8(
                plan,
                quantization=fp8_quantization(train, fmt),
                src_rank=0 if rank == 0 else None,
                src_tensors={
                    lt.name: materialize_local(lt, values) for lt in train.local_tensors(0)
                }
                if rank == 0
                else {},
                dst_tensors=live if rank == 1 else {},
                group=group,
            )
        except Exception as e:  # collected for the test
            out[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    reason = "receive FP8 weights or scales but hold another dtype"
    assert isinstance(out[1], PlanError) and reason in str(out[1])
    assert isinstance(out[0], SyncError) and reason in str(out[0])
    assert all(not v.any() for v in live.values())
