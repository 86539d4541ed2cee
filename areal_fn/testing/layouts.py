"""Hypothesis strategies for fused, padded logical tensors and synthetic layouts."""

from hypothesis import strategies as st

from ..box import Box
from ..layout import FusionPiece, Layout, LogicalTensor
from ..placement import Replicate
from ..tensor_spec import TensorSpec
from .core import meshes, shardings


@st.composite
def fused_layouts(draw: st.DrawFn, *, max_world: int = 16) -> Layout:
    """A layout of 1-3 logical tensors, each interleaving 1-3 canonical tensors in
    ``groups`` row blocks (like Megatron's per-group QKV), with optional padding rows
    and an optional presence constraint (like a pipeline stage)."""
    mesh = draw(meshes(max_world=max_world, max_axes=3))
    canonical: list[TensorSpec] = []
    logical: list[LogicalTensor] = []
    for t in range(draw(st.integers(1, 3))):
        cols = draw(st.integers(1, 5))
        groups = draw(st.integers(1, 3))
        k = draw(st.integers(1, 3))
        rows_per_group = [draw(st.integers(1, 3)) for _ in range(k)]
        names = [f"t{t}.c{i}" for i in range(k)]
        canonical += [
            TensorSpec(name=n, shape=(r * groups, cols), dtype="float32")
            for n, r in zip(names, rows_per_group, strict=True)
        ]
        fusion = []
        row = 0
        for g in range(groups):
            for n, r in zip(names, rows_per_group, strict=True):
                fusion.append(
                    FusionPiece(
                        canonical=n,
                        canonical_box=Box(ranges=((g * r, (g + 1) * r), (0, cols))),
                        logical_box=Box(ranges=((row, row + r), (0, cols))),
                    )
                )
                row += r
        pad = draw(st.integers(0, 3))
        shape = (row + pad, cols)
        sharding = draw(shardings(2, mesh=mesh, partial_ops=()))
        present = ()
        replicated = [
            n
            for n, p in zip(mesh.names, sharding.placements, strict=True)
            if isinstance(p, Replicate)
        ]
        if replicated and draw(st.booleans()):
            axis = draw(st.sampled_from(replicated))
            present = ((axis, draw(st.integers(0, mesh.axis_size(axis) - 1))),)
        logical.append(
            LogicalTensor(
                name=f"fused{t}",
                shape=shape,
                dtype="float32",
                fusion=tuple(fusion),
                sharding=sharding,
                present=present,
            )
        )
    return Layout(
        kind="synthetic", world_size=mesh.size, canonical=tuple(canonical), tensors=tuple(logical)
    )
