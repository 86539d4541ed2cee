"""One torchrun launch (4 ranks, gloo): weight syncs into an FP8 deployment.

Per case, the trainer (its layout on ranks 0-1) holds bf16 shards of a tiny model;
``send_and_receive_fp8`` quantises them (``quantize_shard``, the cut blocks' amax
all-reduced among ranks 0-1) and syncs into an inference layout on ranks 2-3 holding
``float8_e4m3fn`` weights and their ``weight_scale_inv``. Every destination rank gathers
its live tensors to rank 0, which compares them bitwise with ``quantize_fp8`` of the
whole canonical tensors (computed there alone, with ``block_amax`` of the whole tensor)
and the unquantised tensors with the bf16 canonical ones; and records the bytes that
travelled against ``transfer_lower_bound`` of the FP8 layouts and of the bf16 layouts.
Run by ``test_fp8_sync.py``.
"""

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.quantized import Fp8Format, is_fp8_quantized, scale_name
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.fp8 import block_amax, quantize_fp8
from areal_fn.plans.fp8_sync import fp8_layout, fp8_quantization
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.plans.transfer.bound import transfer_lower_bound
from areal_fn.runtime.engines.fsdp2_apply import materialize_local
from areal_fn.runtime.sync.executor import SyncGroup
from areal_fn.runtime.sync.fp8 import send_and_receive_fp8
from areal_fn.strategy.allocation import ParallelDims

TRAINER, INFER = (0, 1), (2, 3)


def spec(hidden: int, inter: int) -> ModelSpec:
    return model_from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 72,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    )


def cases() -> list[tuple[str, ModelSpec, Layout, Layout, Fp8Format]]:
    """(name, model, trainer layout, inference layout, format)."""
    aligned, cut = spec(64, 192), spec(64, 320)
    infer = ParallelDims(tp=2)
    return [
        # 16x16 blocks: every shard boundary on a block boundary
        (
            "fsdp_d2_aligned",
            aligned,
            fsdp2_layout(aligned, ParallelDims(dp=2)),
            inference_layout(aligned, infer, vocab_multiple=1),
            Fp8Format(block=(16, 16)),
        ),
        # 128x128 blocks: fsdp's 160-row halves of gate/up and 32-row halves of q cut blocks
        (
            "fsdp_d2_cut128",
            cut,
            fsdp2_layout(cut, ParallelDims(dp=2)),
            inference_layout(cut, infer, vocab_multiple=1),
            Fp8Format(),
        ),
        # Megatron's fused linear_qkv / linear_fc1 hold pieces of several weights
        (
            "megatron_t2_cut128",
            cut,
            megatron_layout(cut, ParallelDims(tp=2)),
            inference_layout(cut, infer, vocab_multiple=1),
            Fp8Format(),
        ),
    ]


def canonical(s: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {c.name: (torch.randn(c.shape, generator=gen) * 2).bfloat16() for c in s.tensors}


def expected(s: ModelSpec, fmt: Fp8Format, values: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The destination's canonical tensors: quantised weights and scales of the whole."""
    out: dict[str, torch.Tensor] = {}
    for c in s.tensors:
        x = values[c.name]
        if is_fp8_quantized(c.name, c.shape, fmt):
            q, sc = quantize_fp8(x, block_amax(x, block=fmt.block), block=fmt.block)
            out[c.name], out[scale_name(c.name)] = q, sc
        else:
            out[c.name] = x
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def run_case(rank: int, group: SyncGroup, trainers: Any, case: tuple[Any, ...]) -> dict[str, Any]:
    name, s, train, infer, fmt = case
    values = canonical(s, 7)
    src8, dst8 = fp8_layout(train, fmt), fp8_layout(infer, fmt)
    plan = plan_transfers(src8, dst8, src_ranks=TRAINER, dst_ranks=INFER)
    buckets = bucket(plan, 1 << 16, version=1)
    src = {}
    if rank in TRAINER:
        src = {
            lt.name: materialize_local(lt, values)
            for lt in train.local_tensors(TRAINER.index(rank))
        }
    live: dict[str, torch.Tensor] = {}
    if rank in INFER:
        for lt in dst8.local_tensors(INFER.index(rank)):
            live[lt.name] = torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype))
    report = send_and_receive_fp8(
        buckets,
        quantization=fp8_quantization(train, fmt),
        src_rank=TRAINER.index(rank) if rank in TRAINER else None,
        src_tensors=src,
        dst_tensors=live,
        group=group,
        quant_group=trainers,
    )
    got: list[Any] = [None] * 4
    dist.all_gather_object(got, ({k: bits(v) for k, v in live.items()}, report.bytes_sent))
    if rank != 0:
        return {}
    want = expected(s, fmt, values)
    mismatched = []
    for r in INFER:
        for lt in dst8.local_tensors(INFER.index(r)):
            ref = materialize_local(lt, want)
            if not torch.equal(got[r][0][lt.name], bits(ref)):
                mismatched.append(f"{r}:{lt.name}")
    return {
        "case": name,
        "tensors": sum(len(got[r][0]) for r in INFER),
        "scales": sum(k.endswith("_scale_inv") for r in INFER for k in got[r][0]),
        "mismatched": mismatched,
        "sent": sum(b for _, b in got),
        "plan_bytes": plan.bytes_total,
        "fp8_bound": transfer_lower_bound(src8, dst8, src_ranks=TRAINER, dst_ranks=INFER),
        "bf16_bound": transfer_lower_bound(train, infer, src_ranks=TRAINER, dst_ranks=INFER),
        "cut_blocks": sum(len(q.plan.cut_blocks) for q in fp8_quantization(train, fmt)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainers = dist.new_group(list(TRAINER))
    group = SyncGroup.from_world(range(4), timeout_s=60, connect_timeout_s=60)
    record = []
    try:
        for case in cases():
            record.append(run_case(rank, group, trainers, case))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
