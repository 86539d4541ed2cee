"""Weight sync into an FP8 rollout deployment: the trainer quantises, FP8 bytes travel.

The plan is an ordinary transfer plan between the FP8 forms of the two layouts
(:func:`~areal_fn.plans.fp8_sync.fp8_layout`)::

    src8, dst8 = fp8_layout(train, fmt), fp8_layout(infer, fmt)
    plan = bucket(plan_transfers(src8, dst8, src_ranks=[0, 1], dst_ranks=[2, 3]), 64 << 20)
    report = send_and_receive_fp8(plan, quantization=fp8_quantization(train, fmt),
                                  src_rank=..., src_tensors=mine, dst_tensors=live,
                                  group=group, quant_group=trainers)

Each source rank first quantises its pieces of every quantised weight
(:func:`quantize_sources`: :func:`~areal_fn.runtime.hf.fp8_shards.quantize_shard` by
the plan of :func:`~areal_fn.plans.fp8_sync.fp8_quantization`, the amax of blocks that
several ranks' pieces cut all-reduced among ``quant_group``, the source ranks); then
:func:`~areal_fn.runtime.sync.executor.send_and_receive` moves the ``float8_e4m3fn``
values and float32 scales as it moves any tensors (authenticated messages, shadows,
one commit decision). The destination's live tensors are its FP8 weights and their
``weight_scale_inv``; they change only at commit.
"""

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from areal_fn.errors import PlanError
from areal_fn.model.quantized import scale_name
from areal_fn.plans.fp8_sync import Fp8Quantization
from areal_fn.plans.transfer import BucketPlan
from areal_fn.runtime.hf.fp8_shards import quantize_shard
from areal_fn.runtime.sync.executor import SyncGroup, SyncReport, _begin, send_and_receive
from areal_fn.runtime.sync.group import _fail

__all__ = ["quantize_sources", "send_and_receive_fp8"]


def quantize_sources(
    quantization: Sequence[Fp8Quantization],
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Layout rank ``rank``'s local tensors of the FP8 layout from its ``tensors`` (of
    the layout ``quantization`` was planned on): every local tensor holding a quantised
    weight's piece as ``float8_e4m3fn`` (padding 0), plus one ``scale_name(w)`` per
    weight it holds a piece of; the rest as given. Collective over ``group`` (every
    rank of the layout calls it)."""
    out = dict(tensors)
    fp8: dict[str, torch.Tensor] = {}
    for qz in quantization:
        held = qz.pieces[rank]
        if held is None:
            x = torch.zeros(0, 0)
        else:
            name, cbox, lbox = held
            if name not in tensors:
                raise PlanError(
                    f"rank {rank} has no local tensor {name!r}, which holds its piece of "
                    f"{qz.name!r}; pass every local tensor of the source layout"
                )
            x = tensors[name][lbox.slices()].reshape(cbox.shape)
        q, s = quantize_shard(x, qz.plan, qz.slots[rank], group=group, name=qz.name)
        if held is None:
            continue
        local = tensors[name]
        if name not in fp8:
            fp8[name] = torch.zeros(local.shape, dtype=torch.float8_e4m3fn, device=local.device)
        fp8[name][lbox.slices()] = q.reshape(lbox.shape)
        out[scale_name(qz.name)] = s
    out.update(fp8)
    return out


def _wrong_destinations(
    plan: BucketPlan,
    rank: int,
    quantization: Sequence[Fp8Quantization],
    dst_tensors: Mapping[str, torch.Tensor],
) -> list[str]:
    """This rank's live tensors that receive quantised values or scales in another dtype."""
    want = {q.name: torch.float8_e4m3fn for q in quantization}
    want.update({scale_name(q.name): torch.float32 for q in quantization})
    return sorted(
        {
            t.dst_tensor
            for b in plan.buckets
            for t in b.transfers
            if t.dst == rank
            and t.canonical in want
            and t.dst_tensor in dst_tensors
            and dst_tensors[t.dst_tensor].dtype != want[t.canonical]
        }
    )


def send_and_receive_fp8(
    plan: BucketPlan,
    *,
    quantization: Sequence[Fp8Quantization],
    src_rank: int | None,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: MutableMapping[str, torch.Tensor],
    group: SyncGroup,
    quant_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> SyncReport:
    """Quantise this rank's sources (when it is source layout rank ``src_rank``; None
    for a rank that sends nothing), then :func:`send_and_receive` ``plan`` (planned
    between :func:`~areal_fn.plans.fp8_sync.fp8_layout` forms of the two layouts).
    ``src_tensors``: this rank's tensors of the unquantised source layout;
    ``dst_tensors``: its live FP8 weights, scales and unquantised tensors. ``options``:
    :func:`send_and_receive`'s (``wire_dtype`` is refused: FP8 values travel as they are).

    ``PlanError`` (and the group spent, its members raising ``SyncError`` with the reason)
    when this rank's live tensors of quantised weights are not ``float8_e4m3fn`` or their
    scales not float32.
    """
    if "wire_dtype" in options:
        raise PlanError(
            f"wire_dtype={options['wire_dtype']!r}: an FP8 sync sends float8_e4m3fn values and "
            "float32 scales as they are; drop wire_dtype"
        )
    wrong = _wrong_destinations(plan, group.rank, quantization, dst_tensors)
    if wrong:
        reason = (
            f"rank {group.rank}: live tensors {wrong[:3]} receive FP8 weights or scales but "
            "hold another dtype; an FP8 deployment holds its quantised weights as "
            "float8_e4m3fn and their weight_scale_inv as float32 (the dtypes of fp8_layout)"
        )
        _fail(group, _begin(group, plan.version), reason)
        raise PlanError(reason)
    sources: Mapping[str, torch.Tensor] = src_tensors
    if src_rank is not None:
        sources = quantize_sources(quantization, src_rank, src_tensors, group=quant_group)
    return send_and_receive(
        plan, src_tensors=sources, dst_tensors=dst_tensors, group=group, **options
    )
