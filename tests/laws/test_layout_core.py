"""Laws of layouts: pieces tile local tensors; canonical tensors are covered once per replica."""

import math

import torch
from hypothesis import given

from areal_fn.layouts.layout import Layout
from areal_fn.sharding.placement import Partial, Replicate
from areal_fn.testing.layouts import fused_layouts


def replicas(layout: Layout, name: str) -> int:
    t = layout.tensor(name)
    mesh = t.sharding.mesh
    present_axes = {a for a, _ in t.present}
    return math.prod(
        s
        for n, s, p in zip(mesh.names, mesh.sizes, t.sharding.placements, strict=True)
        if isinstance(p, (Replicate, Partial)) and n not in present_axes
    )


@given(fused_layouts())
def test_pieces_tile_every_local_tensor_exactly(layout):
    for r in range(layout.world_size):
        for lt in layout.local_tensors(r):
            count = torch.zeros(lt.shape, dtype=torch.int64)
            for p in lt.pieces:
                count[p.local_box.slices()] += 1
                if p.canonical is not None:
                    assert (
                        p.canonical_box is not None and p.canonical_box.shape == p.local_box.shape
                    )
            assert bool((count == 1).all()), f"rank {r} {lt.name}"


@given(fused_layouts())
def test_canonical_elements_covered_once_per_replica(layout):
    counts = {c.name: torch.zeros(c.shape, dtype=torch.int64) for c in layout.canonical}
    expected = {}
    for t in layout.tensors:
        for f in t.fusion:
            expected[f.canonical] = replicas(layout, t.name)
    for r in range(layout.world_size):
        for lt in layout.local_tensors(r):
            for p in lt.pieces:
                if p.canonical is not None:
                    counts[p.canonical][p.canonical_box.slices()] += 1
    for name, c in counts.items():
        assert bool((c == expected[name]).all()), name


@given(fused_layouts())
def test_materialised_local_tensors_hold_canonical_data(layout):
    """Filling local tensors from pieces equals sharding the fused logical tensor."""
    from areal_fn.sharding.shard import shard

    g = torch.Generator().manual_seed(0)
    canon = {c.name: torch.randn(c.shape, generator=g) for c in layout.canonical}
    for t in layout.tensors:
        full = torch.zeros(t.shape)
        for f in t.fusion:
            full[f.logical_box.slices()] = canon[f.canonical][f.canonical_box.slices()]
        for r in range(layout.world_size):
            lt = t.local(r)
            if lt is None:
                continue
            built = torch.full(lt.shape, float("nan"))
            for p in lt.pieces:
                built[p.local_box.slices()] = (
                    0.0 if p.canonical is None else canon[p.canonical][p.canonical_box.slices()]
                )
            assert torch.equal(built, shard(full, t.sharding, r))


@given(fused_layouts())
def test_local_tensors_are_deterministic(layout):
    for r in range(layout.world_size):
        assert layout.local_tensors(r) == layout.local_tensors(r)
