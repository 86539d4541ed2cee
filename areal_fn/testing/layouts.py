"""Hypothesis strategies for fused, padded logical tensors and synthetic layouts."""

from typing import TYPE_CHECKING

from hypothesis import strategies as st

from areal_fn.layouts.layout import FusionPiece, Layout, LogicalTensor
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.sharding.box import Box
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Replicate

if TYPE_CHECKING:
    from areal_fn.model.spec import ModelSpec
    from areal_fn.strategy.allocation import ParallelDims
import itertools

from areal_fn.testing.core import meshes, shardings

#: A family: canonical tensors sharing ``cols`` and ``groups`` (like q, k, v of one layer).
Family = tuple[tuple[TensorSpec, ...], int, int]


@st.composite
def canonical_families(draw: st.DrawFn, *, max_families: int = 3) -> tuple[Family, ...]:
    out = []
    for t in range(draw(st.integers(1, max_families))):
        cols = draw(st.integers(1, 5))
        groups = draw(st.sampled_from([1, 2, 4]))
        k = draw(st.integers(1, 3))
        specs = tuple(
            TensorSpec(
                name=f"t{t}.c{i}", shape=(draw(st.integers(1, 3)) * groups, cols), dtype="float32"
            )
            for i in range(k)
        )
        out.append((specs, groups, cols))
    return tuple(out)


def _fused(
    name: str, specs: tuple[TensorSpec, ...], groups: int, cols: int, pad: int
) -> tuple[tuple[int, int], tuple[FusionPiece, ...]]:
    fusion = []
    row = 0
    for g in range(groups):
        for s in specs:
            r = s.shape[0] // groups
            fusion.append(
                FusionPiece(
                    canonical=s.name,
                    canonical_box=Box(ranges=((g * r, (g + 1) * r), (0, cols))),
                    logical_box=Box(ranges=((row, row + r), (0, cols))),
                )
            )
            row += r
    return (row + pad, cols), tuple(fusion)


@st.composite
def layouts_for(
    draw: st.DrawFn, families: tuple[Family, ...], *, mesh: Mesh | None = None, max_world: int = 16
) -> Layout:
    """A layout of the given canonical families: each family is fused (interleaved in
    a divisor of its group count, like Megatron's per-group QKV) or kept as separate
    tensors, optionally padded, sharded at random, optionally present on one
    coordinate of a replicated axis (like a pipeline stage)."""
    mesh = mesh if mesh is not None else draw(meshes(max_world=max_world, max_axes=3))
    logical: list[LogicalTensor] = []
    canonical: list[TensorSpec] = []
    for fi, (specs, groups, cols) in enumerate(families):
        canonical += specs
        if len(specs) > 1 and draw(st.booleans()):
            g = draw(st.sampled_from([d for d in (1, 2, 4) if groups % d == 0]))
            parts = [(f"fused{fi}", specs, g)]
        else:
            parts = [(f"sep{fi}.{i}", (s,), 1) for i, s in enumerate(specs)]
        for name, members, g in parts:
            shape, fusion = _fused(name, members, g, cols, draw(st.integers(0, 2)))
            sharding = draw(shardings(2, mesh=mesh, partial_ops=()))
            replicated: list[str] = [
                n
                for n, p in zip(mesh.names, sharding.placements, strict=True)
                if isinstance(p, Replicate)
            ]
            present: tuple[tuple[str, int], ...] = ()
            constrain: bool = draw(st.booleans())
            if replicated and constrain:
                axis = draw(st.sampled_from(replicated))
                present = ((axis, draw(st.integers(0, mesh.axis_size(axis) - 1))),)
            logical.append(
                LogicalTensor(
                    name=name,
                    shape=shape,
                    dtype="float32",
                    fusion=fusion,
                    sharding=sharding,
                    present=present,
                )
            )
    return Layout(
        kind="synthetic", world_size=mesh.size, canonical=tuple(canonical), tensors=tuple(logical)
    )


@st.composite
def fused_layouts(draw: st.DrawFn, *, max_world: int = 16) -> Layout:
    """A synthetic layout of 1-3 families of canonical tensors."""
    return draw(layouts_for(draw(canonical_families()), max_world=max_world))


@st.composite
def layout_pairs(draw: st.DrawFn, *, max_world: int = 16) -> tuple[Layout, Layout]:
    """Two independent layouts of the same canonical tensors (different meshes, fusions, shardings)."""
    fams = draw(canonical_families())
    return draw(layouts_for(fams, max_world=max_world)), draw(
        layouts_for(fams, max_world=max_world)
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def megatron_dims_for(
    draw: st.DrawFn, model: "ModelSpec", *, max_world: int = 16
) -> "ParallelDims":
    """Megatron degrees valid for ``model`` (TP divides heads/KV/channels, the linear
    key heads and the gated shared expert, and the hidden size with MTP layers, EP the
    experts, PP x VPP at most the layers, expert TP 1 for biased experts)."""
    import math

    from areal_fn.strategy.allocation import ParallelDims

    dense = [model.intermediate_size] if any(not m for m in model.moe_layers) else []
    shared = model.num_shared_experts * model.moe_intermediate_size
    latents = [model.q_lora_rank, model.kv_lora_rank + model.qk_rope_head_dim, shared]
    mtp = [model.hidden_size] if model.mtp_layers else []  # eh_proj's rows
    la = model.linear_attention  # GatedDeltaNet: whole key heads; the gated shared expert
    gated = [model.shared_expert_size, *([la.key_heads] if la is not None else [])]
    g = math.gcd(
        model.num_attention_heads, model.num_key_value_heads, *dense, *latents, *mtp, *gated
    )
    tp = draw(st.sampled_from([d for d in _divisors(g) if d <= max_world]))
    pp = draw(st.integers(1, min(model.num_layers, max(1, max_world // tp), 4)))
    vpp = draw(st.integers(1, max(1, model.num_layers // pp))) if pp > 1 else 1
    vpp = min(vpp, 3)
    dp = draw(st.integers(1, max(1, max_world // (tp * pp))))
    ep = etp = 1
    if model.is_moe:
        stage = dp * tp
        ep = draw(st.sampled_from([d for d in _divisors(model.num_experts) if stage % d == 0]))
        etp = draw(
            st.sampled_from(
                [
                    d
                    for d in _divisors(model.moe_intermediate_size)
                    if stage % (ep * d) == 0 and (d == 1 or not model.has_expert_biases)
                ]
            )
        )
    return ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)


@st.composite
def megatron_layouts_for(draw: st.DrawFn, model: "ModelSpec", *, max_world: int = 16) -> Layout:
    """A Megatron layout of ``model`` with random degrees, naming and an uneven stage split."""
    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.pipeline.partition import StagePlan

    dims = draw(megatron_dims_for(model, max_world=max_world))
    k = dims.pp * dims.vpp
    # random composition of num_layers into k positive parts
    cuts = (
        sorted(
            draw(
                st.lists(
                    st.integers(1, model.num_layers - 1),
                    min_size=k - 1,
                    max_size=k - 1,
                    unique=True,
                )
            )
        )
        if k > 1
        else []
    )
    bounds = [0, *cuts, model.num_layers]
    lengths = tuple(b - a for a, b in itertools.pairwise(bounds))
    stages = StagePlan(
        costs=(1.0,) * model.num_layers, num_stages=dims.pp, vpp=dims.vpp, stage_lengths=lengths
    )
    return megatron_layout(
        model,
        dims,
        # the Transformer-Engine naming is refused for gated-delta-net models
        naming=draw(st.sampled_from(["local"] if model.linear_attention else ["local", "te"])),
        stages=stages,
        grouped_gemm=draw(st.booleans()),
    )


@st.composite
def inference_dims_for(
    draw: st.DrawFn, model: "ModelSpec", *, max_world: int = 16, min_pp: int = 1
) -> "ParallelDims":
    """SGLang / vLLM degrees valid for ``model`` (TP divides the heads, the channels and
    the 64-padded vocabulary, and divides the KV heads or is a multiple of them; PP
    from ``min_pp`` to the layers; ``min_pp`` must be at most the layers)."""
    import math

    from areal_fn.strategy.allocation import ParallelDims
    from areal_fn.strategy.rules import engine_padded_vocab

    nkv = model.num_key_value_heads
    sizes = [model.num_attention_heads, engine_padded_vocab(model.vocab_size)]
    if not all(model.moe_layers):
        sizes.append(model.intermediate_size)
    if model.is_moe:
        sizes.append(model.moe_intermediate_size)
    if model.linear_attention is not None:  # whole key-head groups per rank
        sizes.append(model.linear_attention.key_heads)
    g = math.gcd(*sizes)
    top = max(1, max_world // min_pp)
    tp = draw(
        st.sampled_from([d for d in _divisors(g) if d <= top and (nkv % d == 0 or d % nkv == 0)])
    )
    pp = draw(st.integers(min_pp, max(min_pp, min(model.num_layers, max_world // tp))))
    dp = draw(st.integers(1, max(1, max_world // (tp * pp))))
    return ParallelDims(dp=dp, tp=tp, pp=pp)
