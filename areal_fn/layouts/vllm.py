"""vLLM's own parameters: every rank's fused tensors, as vLLM builds and loads them.

:func:`~areal_fn.layouts.inference.inference_layout` describes an inference engine
over canonical (HF) names, one tensor per checkpoint tensor. A vLLM worker holds
other tensors: its model's ``named_parameters()`` in model format (before its CPU
kernels repack them), fused per tensor-parallel rank. :func:`vllm_layout` describes
those, so that a weight update plans, for each vLLM rank, exactly the canonical
boxes its parameters are made of and writes them where vLLM's own loaders would:

- ``self_attn.qkv_proj.weight`` / ``.bias`` (``QKVParallelLinear``): rank ``r``
  holds ``[q_r; k_r; v_r]``, its query heads then its KV heads. With
  ``tp <= num_key_value_heads`` rank ``r`` holds KV heads ``r*kv/tp ..``; with more
  ranks than KV heads (``tp`` a multiple of them) it holds head ``r // (tp/kv)``, so
  the same canonical rows sit in ``tp/kv`` ranks' blocks. The logical tensor is the
  ranks' blocks end to end, ``Shard(0)`` over ``tp``.
- ``mlp.gate_up_proj.weight`` (``MergedColumnParallelLinear``): rank ``r`` holds
  ``[gate_r; up_r]``.
- routed experts (``FusedMoE``, qwen3_moe): one ``mlp.experts.routed_experts.w13_weight``
  ``[E, 2*I, H]`` per layer, expert ``e``'s rank-``r`` block ``[gate_r; up_r]`` at rows
  ``r*2I/tp ..`` (``Shard(1)``), and ``w2_weight`` ``[E, H, I]`` (``Shard(2)``), every
  expert on every rank (no expert parallelism); the router ``mlp.gate.weight`` replicated.
- every other tensor keeps its HF name and the engines' placement
  (:mod:`areal_fn.layouts.inference`): ``o_proj`` / ``down_proj`` row-wise, the
  vocabulary padded to a multiple of 64 and split, norms replicated.

Families: the dense decoder families vLLM loads with ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` (:data:`VLLM_FAMILIES`). Others are refused with
:class:`~areal_fn.errors.LayoutError` naming them. Degrees: ``t`` and ``p`` (a
deployment's ranks are one replica; ``d`` is refused: each vLLM data-parallel replica
is its own deployment).

Sources (vLLM 0.32, ``vllm/model_executor/layers/linear.py``:
``QKVParallelLinear.weight_loader`` places shard ``q`` at 0, ``k`` after the rank's
query rows, ``v`` after its KV rows, and with ``num_kv_head_replicas > 1`` loads KV
head ``tp_rank // num_kv_head_replicas``; ``MergedColumnParallelLinear`` places shard
0 (gate) then shard 1 (up)). ``tests/oracles/test_vllm_layout.py`` checks every rank
against real vLLM workers that loaded the same checkpoint.
"""

import re

from areal_fn.errors import LayoutError
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import FusionPiece, Layout, LayoutKind, LogicalTensor
from areal_fn.model.families import FAMILIES
from areal_fn.model.families.serving import VllmFused
from areal_fn.model.spec import ModelSpec, layer_of
from areal_fn.sharding.box import Box
from areal_fn.sharding.placement import Replicate, Shard
from areal_fn.sharding.sharding import Sharding
from areal_fn.strategy.allocation import Backend, ParallelDims
from areal_fn.strategy.coerce import Strategy, as_dims
from areal_fn.typecheck import beartype

__all__ = ["VLLM_FAMILIES", "vllm_layout"]

#: The ``model_type`` values whose vLLM parameters this layout describes
#: (``Serving.vllm_layout`` of their families).
VLLM_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.serving.vllm_layout)


@beartype
def vllm_layout(model: ModelSpec, dims: Strategy) -> Layout:
    """Every rank's parameters in a vLLM deployment of ``dims`` (``t``, ``p``), by vLLM's names.

    ``dims`` may be a ``vllm:`` allocation string or component (``"vllm:t2"``). The
    canonical tensors are ``model``'s; each local tensor is what
    ``named_parameters()`` of a vLLM worker holds in model format.
    """
    dims = as_dims(dims, caller="vllm_layout", backends=(Backend.VLLM, Backend.SGLANG))
    if model.model_type not in VLLM_FAMILIES:
        raise LayoutError(
            f"vllm_layout: model_type={model.model_type!r} is not one whose vLLM parameters "
            f"this layout describes; supported: {list(VLLM_FAMILIES)} (dense families "
            "loaded through QKVParallelLinear and MergedColumnParallelLinear)"
        )
    if dims.dp != 1:
        raise LayoutError(
            f"vllm_layout: d={dims.dp}: a vLLM deployment's layout is one replica (t x p "
            "ranks); each data-parallel replica is its own deployment: use d1"
        )
    base = inference_layout(model, dims)
    tensors: list[LogicalTensor] = []
    fused: set[str] = set()
    experts = _experts(model)
    for t in base.tensors:
        name = t.name
        if name in fused:
            continue
        moe = experts.get(name)
        if moe is not None:
            layer, expert_names = moe
            fused.update(expert_names)
            tensors.extend(_stacked_experts(base, model, dims, layer))
            continue
        group = _fusion_group(model, name)
        if group is None:
            tensors.append(t)
            continue
        prefix, spec, suffix = group
        names = [f"{prefix}{p}.{suffix}" for p in spec.parts]
        fused.update(names)
        tensors.append(
            _fused(base, model, dims, names, f"{prefix}{spec.module}.{suffix}", spec.qkv)
        )
    return Layout(
        kind=LayoutKind.INFERENCE,
        world_size=base.world_size,
        canonical=base.canonical,
        tensors=tuple(tensors),
    )


def _fusion_group(model: ModelSpec, name: str) -> tuple[str, VllmFused, str] | None:
    """``(layer prefix, fused module, weight|bias)`` for a tensor vLLM fuses, else None."""
    layer = layer_of(name)
    if layer is None:
        return None
    prefix = f"model.layers.{layer}."
    module, _, suffix = name.removeprefix(prefix).rpartition(".")
    for spec in model.family.serving.vllm_fused:
        if module in spec.parts:
            return prefix, spec, suffix
    return None


def _fused(
    base: Layout,
    model: ModelSpec,
    dims: ParallelDims,
    names: list[str],
    fused_name: str,
    qkv: bool,
) -> LogicalTensor:
    """The ranks' blocks of a fused column-parallel tensor, end to end, ``Shard(0)`` on ``tp``."""
    tp = dims.tp
    specs = {c.name: c for c in base.canonical}
    shapes = [specs[n].shape for n in names]
    if qkv:
        nkv = model.num_key_value_heads
        q_rows = shapes[0][0] // tp
        if tp <= nkv:
            kv_rows = shapes[1][0] // tp
            kv_start = [r * kv_rows for r in range(tp)]
        else:
            kv_rows = shapes[1][0] // nkv  # one KV head per rank
            kv_start = [(r // (tp // nkv)) * kv_rows for r in range(tp)]
        rows = [q_rows, kv_rows, kv_rows]
        starts = [[r * q_rows for r in range(tp)], kv_start, kv_start]
    else:
        rows = [s[0] // tp for s in shapes]
        starts = [[r * n for r in range(tp)] for n in rows]
    block = sum(rows)
    rest = shapes[0][1:]
    fusion: list[FusionPiece] = []
    for r in range(tp):
        at = r * block
        for name, n, start in zip(names, rows, starts, strict=True):
            fusion.append(
                FusionPiece(
                    canonical=name,
                    canonical_box=Box(ranges=((start[r], start[r] + n), *((0, d) for d in rest))),
                    logical_box=Box(ranges=((at, at + n), *((0, d) for d in rest))),
                )
            )
            at += n
    first = base.tensor(names[0])
    mesh = first.sharding.mesh  # (dp, pp, tp): q/gate/up are never on the factored KV mesh
    return LogicalTensor(
        name=fused_name,
        shape=(tp * block, *rest),
        dtype=first.dtype,
        fusion=tuple(fusion),
        sharding=Sharding(mesh=mesh, placements=(Replicate(), Replicate(), Shard(dim=0))),
        present=first.present,
    )


def _experts(model: ModelSpec) -> dict[str, tuple[int, set[str]]]:
    """Each layer's first expert tensor -> (layer, every expert tensor of that layer)."""
    ex = model.family.serving.vllm_experts
    parts = [re.escape(m).replace(r"\{e\}", r"\d+") for m in (ex.gate, ex.up, ex.down)]
    pattern = re.compile(rf"^model\.layers\.(\d+)\.(?:{'|'.join(parts)})\.weight$")
    by_layer: dict[int, list[str]] = {}
    for t in model.tensors:
        m = pattern.match(t.name)
        if m is not None:
            by_layer.setdefault(int(m[1]), []).append(t.name)
    return {names[0]: (layer, set(names)) for layer, names in by_layer.items()}


def _stacked_experts(
    base: Layout, model: ModelSpec, dims: ParallelDims, layer: int
) -> list[LogicalTensor]:
    """``w13_weight [E, tp*2*Ir, H]`` (``Shard(1)``) and ``w2_weight [E, H, I]`` (``Shard(2)``)."""
    tp, n, ex = dims.tp, model.num_experts, model.family.serving.vllm_experts
    prefix = f"model.layers.{layer}."

    def canonical(module: str, e: int) -> str:
        return f"{prefix}{module.format(e=e)}.weight"

    gate = base.tensor(canonical(ex.gate, 0))
    inter, hidden = (c.shape for c in base.canonical if c.name == gate.name).__next__()
    ir = inter // tp
    w13: list[FusionPiece] = []
    w2: list[FusionPiece] = []
    for e in range(n):
        for r in range(tp):
            for k, part in enumerate((ex.gate, ex.up)):
                at = r * 2 * ir + k * ir
                w13.append(
                    FusionPiece(
                        canonical=canonical(part, e),
                        canonical_box=Box(ranges=((r * ir, (r + 1) * ir), (0, hidden))),
                        logical_box=Box(ranges=((e, e + 1), (at, at + ir), (0, hidden))),
                    )
                )
        w2.append(
            FusionPiece(
                canonical=canonical(ex.down, e),
                canonical_box=Box(ranges=((0, hidden), (0, inter))),
                logical_box=Box(ranges=((e, e + 1), (0, hidden), (0, inter))),
            )
        )
    mesh = gate.sharding.mesh
    return [
        LogicalTensor(
            name=prefix + ex.w13,
            shape=(n, 2 * inter, hidden),
            dtype=gate.dtype,
            fusion=tuple(w13),
            sharding=Sharding(mesh=mesh, placements=(Replicate(), Replicate(), Shard(dim=1))),
            present=gate.present,
        ),
        LogicalTensor(
            name=prefix + ex.w2,
            shape=(n, hidden, inter),
            dtype=gate.dtype,
            fusion=tuple(w2),
            sharding=Sharding(mesh=mesh, placements=(Replicate(), Replicate(), Shard(dim=2))),
            present=gate.present,
        ),
    ]
