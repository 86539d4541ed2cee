"""Checkpoint plans over layouts with strided pieces (gpt-oss experts under Megatron-Core).

Executed on simulated ranks in one process: every rank's write plan, applied to the
local tensors the conversion gives it (``to_megatron``, independent of lifting), must
rebuild every canonical tensor element for element, each element written once; every
rank's load plan, applied to the canonical tensors, must rebuild that rank's local
tensors. Random tiny gpt-oss models, random Megatron layouts, and FSDP2 / inference /
Megatron partners for the other side.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.layouts.lift import apply_view
from areal_fn.plans.checkpoint.read import plan_load
from areal_fn.plans.checkpoint.write import plan_save
from areal_fn.plans.convert import to_megatron
from areal_fn.testing.layouts import megatron_layouts_for
from areal_fn.testing.models import model_specs
from tests.laws.test_strided_transfer import partners
from tests.manifest_util import weights_manifest


def _seen(views: dict, name: str, t: torch.Tensor) -> torch.Tensor:  # type: ignore[type-arg]
    return apply_view(views[name], t) if name in views else t


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_strided_layout_saves_and_loads_every_element(data) -> None:  # type: ignore[no-untyped-def]
    model = data.draw(model_specs("gpt_oss", max_layers=2))
    saver = data.draw(st.one_of(megatron_layouts_for(model, max_world=8), partners(model)))
    loader = data.draw(st.one_of(megatron_layouts_for(model, max_world=8), partners(model)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}

    plan = plan_save(saver)
    assert bool(plan.views) == saver.is_strided
    views = dict(plan.views)
    rebuilt = {n: torch.full_like(t, float("nan")) for n, t in canon.items()}
    written = {n: torch.zeros(t.shape, dtype=torch.int64) for n, t in canon.items()}
    for r in range(saver.world_size):
        local = to_megatron(canon, saver, r)
        for p in plan.for_rank(r):
            region = _seen(views, p.tensor, local[p.tensor])[p.local_box.slices()]
            rebuilt[p.canonical][p.box.slices()] = region.reshape(p.box.shape)
            written[p.canonical][p.box.slices()] += 1
    assert all(torch.equal(rebuilt[n], canon[n]) for n in canon)
    assert all(bool((w == 1).all()) for w in written.values())

    manifest = weights_manifest(plan, model)
    for r in range(loader.world_size):
        lp = plan_load(manifest, loader, r)
        want = to_megatron(canon, loader, r)
        got = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
        lviews = dict(lp.views)
        for rp in lp.reads:
            region = _seen(lviews, rp.tensor, got[rp.tensor])[rp.local_box.slices()]
            region.copy_(canon[rp.canonical][rp.box.slices()].reshape(region.shape))
        for pad in lp.padding:
            _seen(lviews, pad.tensor, got[pad.tensor])[pad.local_box.slices()] = 0.0
        assert all(torch.equal(got[n], want[n]) for n in want), r
