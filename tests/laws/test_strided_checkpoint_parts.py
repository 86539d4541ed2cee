"""Checkpoints of layouts with strided pieces that cut inside units of their steps.

Megatron's per-expert adapters hold columns ``e::E`` of PEFT's fused expert ``lora_B``
(one phase of step ``E`` each): the save plan writes each as the single-column boxes
it is made of, and a load reads any stored tiling, into any layout, as the plain boxes
that make up the intersections. The data checks run the plans on real tensors: each
rank's local tensors come from the canonical ones by conversion (``to_megatron``),
the written boxes are read through the plans' views, and the loaded tensors must equal
the destination's conversion bitwise.
"""

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_fn import ParallelDims, fsdp2_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lift import apply_view, lifted_shape
from areal_fn.layouts.lora import adapter_layout
from areal_fn.model.lora import EXPERT_PARAMETERS, LoraConfig
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.checkpoint.manifest import CheckpointManifest, Chunk
from areal_fn.plans.checkpoint.read import plan_load
from areal_fn.plans.checkpoint.write import lift_parts, plan_save, unlift_parts
from areal_fn.plans.convert import to_megatron
from areal_fn.sharding.box import Box
from tests.invalid.test_lora_expert_errors import MOE
from tests.invalid.test_strided_refusals import MODEL as GPT_OSS
from tests.invalid.test_strided_refusals import STRIDED
from tests.laws.test_checkpoint_plan import manifest_of

Stored = dict[tuple[str, Box], torch.Tensor]


def _seen(views: tuple[tuple[str, object], ...], name: str, t: torch.Tensor) -> torch.Tensor:
    view = dict(views).get(name)
    return t if view is None else apply_view(view, t)  # type: ignore[arg-type]


def saved(layout: Layout, canon: dict[str, torch.Tensor]) -> Stored:
    """What a save of ``layout`` stores: each written box, read from its rank's locals."""
    plan = plan_save(layout)
    out: Stored = {}
    count = {c.name: torch.zeros(c.shape, dtype=torch.int32) for c in layout.canonical}
    for rw in plan.ranks:
        local = to_megatron(canon, layout, rw.rank)
        for p in rw.pieces:
            region = _seen(plan.views, p.tensor, local[p.tensor])[p.local_box.slices()]
            out[(p.canonical, p.box)] = region.reshape(p.box.shape).clone()
            count[p.canonical][p.box.slices()] += 1
    for c in layout.canonical:  # every element written once, and the right one
        assert bool((count[c.name] == 1).all()), c.name
    for (name, box), t in out.items():
        assert torch.equal(t, canon[name][box.slices()]), (name, box)
    return out


def check_load(
    manifest: CheckpointManifest, stored: Stored, layout: Layout, canon: dict[str, torch.Tensor]
) -> int:
    """Load ``stored`` into every rank of ``layout``: bitwise its conversion; the reads."""
    reads = 0
    for r in range(layout.world_size):
        plan = plan_load(manifest, layout, r)
        want = to_megatron(canon, layout, r)
        got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
        for rp in plan.reads:
            region = _seen(plan.views, rp.tensor, got[rp.tensor])[rp.local_box.slices()]
            src = stored[(rp.canonical, rp.chunk)][rp.box.relative_to(rp.chunk).slices()]
            region.copy_(src.reshape(region.shape))
            reads += 1
        for pad in plan.padding:  # padding loads as zero
            _seen(plan.views, pad.tensor, got[pad.tensor])[pad.local_box.slices()] = 0.0
        for name, t in want.items():
            assert torch.equal(got[name], t), (r, name)
    return reads


EXPERTS = LoraConfig(rank=2, target_modules=("o_proj",), target_parameters=EXPERT_PARAMETERS)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("megatron:d2e2", "megatron:d2p2e2"),
        ("megatron:d4e2", "fsdp:d4"),
        ("fsdp:d4", "megatron:d4e2"),
        ("megatron:d2e2", "megatron:d4e4"),
        ("megatron:d2p2e2", "megatron:d4e4"),
    ],
)
def test_megatron_expert_adapters_save_and_load_under_any_strategy(src: str, dst: str) -> None:
    model = model_from_hf_config(MOE)
    a, b = (adapter_layout(layout_for(model, s), model, EXPERTS) for s in (src, dst))
    g = torch.Generator().manual_seed(3)
    canon = {c.name: torch.randn(c.shape, generator=g) for c in a.canonical}
    stored = saved(a, canon)
    assert check_load(manifest_of(a), stored, b, canon) > 0


def test_a_stored_chunk_that_cuts_inside_units_is_read_as_its_plain_boxes() -> None:
    """A chunk of gpt-oss's ``gate_up_proj`` that ends at an odd column splits a (gate,
    up) pair: the strided Megatron layout reads it as the boxes it is made of."""
    plain = fsdp2_layout(GPT_OSS, ParallelDims(dp=2))
    manifest = manifest_of(plain)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    e, h, n = next(t.shape for t in manifest.tensors if t.name == name)
    odd = (
        Chunk(box=Box(ranges=((0, e), (0, h), (0, 3))), rank=0),
        Chunk(box=Box(ranges=((0, e), (0, h), (3, n))), rank=1),
    )
    cut = attrs.evolve(
        manifest,
        tensors=tuple(
            attrs.evolve(t, chunks=odd) if t.name == name else t for t in manifest.tensors
        ),
    )
    g = torch.Generator().manual_seed(4)
    canon = {c.name: torch.randn(c.shape, generator=g) for c in plain.canonical}
    stored = {(t.name, c.box): canon[t.name][c.box.slices()] for t in cut.tensors for c in t.chunks}
    check_load(cut, stored, STRIDED, canon)
    check_load(cut, stored, plain, canon)


@st.composite
def boxes_and_steps(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], Box]:
    steps = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3)))
    shape = tuple(s * draw(st.integers(1, 4)) for s in steps)
    ranges = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        ranges.append((lo, draw(st.integers(lo + 1, n))))
    return shape, steps, Box(ranges=tuple(ranges))


@given(boxes_and_steps())
def test_lifted_parts_hold_the_box_element_for_element(case) -> None:  # type: ignore[no-untyped-def]
    """A plain box's lifted parts, and each part's plain boxes back, hold exactly the
    box's elements, once each, in torch's own reshaped view."""
    shape, steps, box = case
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    up = t.view(lifted_shape(shape, steps))
    seen = torch.zeros(shape, dtype=torch.int32)
    for lifted, plain in lift_parts(box, steps):
        assert torch.equal(up[lifted.slices()].reshape(-1), t[plain.slices()].reshape(-1))
        for part, back in unlift_parts(lifted, steps):
            assert torch.equal(up[part.slices()].reshape(-1), t[back.slices()].reshape(-1))
            seen[back.slices()] += 1
    want = torch.zeros(shape, dtype=torch.int32)
    want[box.slices()] = 1
    assert torch.equal(seen, want)


@pytest.mark.parametrize(
    ("src", "dst"), [("megatron:d4e2", "fsdp:d4"), ("fsdp:d2", "megatron:d2e2")]
)
def test_weight_sync_moves_megatron_expert_adapters_exactly(src: str, dst: str) -> None:
    """The transfer planner shares the lifting: Megatron's per-expert adapters sync with
    FSDP2's fused ones bitwise, moving the lower bound of bytes."""
    from areal_fn.plans.transfer import plan_transfers
    from areal_fn.plans.transfer.apply import apply_transfers
    from areal_fn.plans.transfer.bound import transfer_lower_bound

    model = model_from_hf_config(MOE)
    a, b = (adapter_layout(layout_for(model, s), model, EXPERTS) for s in (src, dst))
    g = torch.Generator().manual_seed(6)
    canon = {c.name: torch.randn(c.shape, generator=g) for c in a.canonical}
    n = a.world_size
    ranks = {"src_ranks": range(n), "dst_ranks": range(n, n + b.world_size)}
    plan = plan_transfers(a, b, **ranks)
    src_t = {r: to_megatron(canon, a, r) for r in range(n)}
    dst_t = {
        n + j: {lt.name: torch.full(lt.shape, float("nan")) for lt in b.local_tensors(j)}
        for j in range(b.world_size)
    }
    apply_transfers(
        plan.transfers, src_t, dst_t, src_views=plan.src_views, dst_views=plan.dst_views
    )
    for j in range(b.world_size):
        for name, t in to_megatron(canon, b, j).items():
            assert torch.equal(dst_t[n + j][name], t), (j, name)
    assert plan.bytes_total == transfer_lower_bound(a, b, **ranks)
