"""Laws of transfer plans on random layout pairs, executed on simulated ranks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.layouts.layout import Layout
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.plans.transfer.apply import apply_transfers
from areal_fn.plans.transfer.bound import required_bytes, transfer_lower_bound, union_numel
from areal_fn.sharding.box import Box
from areal_fn.testing.layouts import layout_pairs


def materialise(
    layout: Layout, canon: dict[str, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    out = {}
    for lt in layout.local_tensors(rank):
        t = torch.full(lt.shape, float("nan"))
        for p in lt.pieces:
            if p.canonical is not None:
                t[p.local_box.slices()] = canon[p.canonical][p.canonical_box.slices()]
            else:
                t[p.local_box.slices()] = 0.0
        out[lt.name] = t
    return out


def canonical_data(layout: Layout) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {c.name: torch.randn(c.shape, generator=g) for c in layout.canonical}


@st.composite
def placed_pairs(draw):
    src, dst = draw(layout_pairs())
    world = max(src.world_size, dst.world_size) * 2
    if draw(st.booleans()):  # colocated: overlapping ranks
        src_ranks = list(range(src.world_size))
        dst_ranks = list(range(dst.world_size))
    else:  # disaggregated: disjoint ranks, shuffled
        ranks = draw(st.permutations(range(world)))
        src_ranks = list(ranks[: src.world_size])
        dst_ranks = list(ranks[src.world_size : src.world_size + dst.world_size])
    return src, dst, src_ranks, dst_ranks


@given(placed_pairs())
def test_executing_a_plan_reproduces_destination_pieces(case):
    src, dst, sr, dr = case
    canon = canonical_data(src)
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    src_t = {g: materialise(src, canon, i) for i, g in enumerate(sr)}
    dst_t = {
        g: {lt.name: torch.full(lt.shape, float("nan")) for lt in dst.local_tensors(j)}
        for j, g in enumerate(dr)
    }
    # padding is not transferred; it stays as the receiver initialised it (zero here)
    for j, g in enumerate(dr):
        for lt in dst.local_tensors(j):
            for p in lt.pieces:
                if p.canonical is None:
                    dst_t[g][lt.name][p.local_box.slices()] = 0.0
    apply_transfers(plan.transfers, src_t, dst_t)
    for j, g in enumerate(dr):
        want = materialise(dst, canon, j)
        for name, t in want.items():
            assert torch.equal(dst_t[g][name], t), (g, name)


@given(placed_pairs())
def test_each_destination_element_received_exactly_once(case):
    src, dst, sr, dr = case
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    for j, g in enumerate(dr):
        for lt in dst.local_tensors(j):
            count = torch.zeros(lt.shape, dtype=torch.int64)
            for t in plan.transfers:
                if t.dst == g and t.dst_tensor == lt.name:
                    count[t.dst_box.slices()] += 1
            for p in lt.pieces:
                want = 0 if p.canonical is None else 1
                assert bool((count[p.local_box.slices()] == want).all())


def marked_bound(src, dst, sr, dr) -> dict[int, int]:
    """Brute force, element by element: what each destination rank needs (each element
    once) that the same global rank does not hold in the source layout."""
    held: dict[int, dict[str, torch.Tensor]] = {}
    for i, g in enumerate(sr):
        marks = {c.name: torch.zeros(c.shape, dtype=torch.bool) for c in src.canonical}
        for lt in src.local_tensors(i):
            for p in lt.pieces:
                if p.canonical is not None:
                    marks[p.canonical][p.canonical_box.slices()] = True
        held[g] = marks
    out = {}
    for j, g in enumerate(dr):
        need = {c.name: torch.zeros(c.shape, dtype=torch.bool) for c in dst.canonical}
        for lt in dst.local_tensors(j):
            for p in lt.pieces:
                if p.canonical is not None:
                    need[p.canonical][p.canonical_box.slices()] = True
        out[g] = 0
        for c in src.canonical:
            mine = held[g][c.name] if g in held else torch.zeros(c.shape, dtype=torch.bool)
            out[g] += int((need[c.name] & ~mine).sum()) * DTYPE_BYTES[c.dtype]
    return out


@given(placed_pairs())
def test_bytes_moved_equal_the_lower_bound(case):
    """The bound from the two layouts (``transfer_lower_bound``) equals the element-wise
    brute force, and the planner moves exactly that many bytes, none more."""
    src, dst, sr, dr = case
    plan = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    brute = marked_bound(src, dst, sr, dr)
    assert dict(required_bytes(src, dst, src_ranks=sr, dst_ranks=dr)) == brute
    bound = transfer_lower_bound(src, dst, src_ranks=sr, dst_ranks=dr)
    assert bound == sum(brute.values())
    assert plan.bytes_total == bound
    assert plan.recv_bytes() == brute
    assert sum(plan.send_bytes().values()) == sum(plan.recv_bytes().values()) == plan.bytes_total


@given(placed_pairs())
def test_a_plan_that_ignores_colocated_sources_exceeds_the_bound(case):
    """The bound does not follow the planner: planning a colocated pair as if the ranks
    were disjoint moves every destination byte, more than the bound whenever a
    destination rank holds some of what it needs."""
    src, dst, _, _ = case
    sr, dr = range(src.world_size), range(dst.world_size)
    bound = transfer_lower_bound(src, dst, src_ranks=sr, dst_ranks=dr)
    shifted = range(src.world_size, src.world_size + dst.world_size)
    wasteful = plan_transfers(src, dst, src_ranks=sr, dst_ranks=shifted)
    held = sum(marked_bound(src, dst, sr, shifted).values()) - bound
    assert wasteful.bytes_total == bound + held
    assert (wasteful.bytes_total > bound) == (held > 0)


@st.composite
def box_sets(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        ranges = []
        for n in shape:
            lo = draw(st.integers(0, n))
            ranges.append((lo, draw(st.integers(lo, n))))
        boxes.append(Box(ranges=tuple(ranges)))
    return shape, boxes


@given(box_sets())
def test_union_numel_counts_each_element_once(case):
    shape, boxes = case
    marks = torch.zeros(shape, dtype=torch.bool)
    for b in boxes:
        marks[b.slices()] = True
    assert union_numel(boxes) == int(marks.sum())


@given(placed_pairs(), st.integers(4, 64))
def test_planning_and_buckets_are_deterministic_and_bounded(case, max_bytes):
    src, dst, sr, dr = case
    a = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    b = plan_transfers(src, dst, src_ranks=sr, dst_ranks=dr)
    assert a == b and str(a) == str(b)
    ba, bb = bucket(a, max_bytes, version=3), bucket(b, max_bytes, version=3)
    assert ba == bb
    assert all(0 < bk.nbytes <= max_bytes for bk in ba.buckets)
    assert sum(t.nbytes for t in ba.transfers) == sum(t.nbytes for t in a.transfers)
    # buckets preserve the plan's effect
    canon = canonical_data(src)
    src_t = {g: materialise(src, canon, i) for i, g in enumerate(sr)}
    d1 = {
        g: {lt.name: torch.zeros(lt.shape) for lt in dst.local_tensors(j)} for j, g in enumerate(dr)
    }
    d2 = {
        g: {lt.name: torch.zeros(lt.shape) for lt in dst.local_tensors(j)} for j, g in enumerate(dr)
    }
    apply_transfers(a.transfers, src_t, d1)
    apply_transfers(ba.transfers, src_t, d2)
    for g in d1:
        for n in d1[g]:
            assert torch.equal(d1[g][n], d2[g][n])


@given(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3))
def test_sources_are_balanced_across_replicas(replicas, dst_world, rows_per_dst):
    """A fully replicated source serving a row-sharded destination: every replica
    sends the same bytes (to within one destination shard)."""
    from areal_fn import Box, Mesh, Replicate, Shard, Sharding, TensorSpec
    from areal_fn.layouts.layout import FusionPiece, LogicalTensor

    rows, cols = dst_world * rows_per_dst, 3
    spec = TensorSpec(name="w", shape=(rows, cols), dtype="float32")
    fusion = (
        FusionPiece(
            canonical="w", canonical_box=Box.full((rows, cols)), logical_box=Box.full((rows, cols))
        ),
    )

    def layout(mesh, placement):
        t = LogicalTensor(
            name="w",
            shape=(rows, cols),
            dtype="float32",
            fusion=fusion,
            sharding=Sharding(mesh=mesh, placements=(placement,)),
        )
        return Layout(kind="synthetic", world_size=mesh.size, canonical=(spec,), tensors=(t,))

    src = layout(Mesh.of(r=replicas), Replicate())
    dst = layout(Mesh.of(d=dst_world), Shard(dim=0))
    plan = plan_transfers(
        src, dst, src_ranks=range(replicas), dst_ranks=range(replicas, replicas + dst_world)
    )
    shard_bytes = rows_per_dst * cols * 4
    sends = list(plan.send_bytes().values())
    assert sum(sends) == rows * cols * 4
    assert max(sends) - min(sends) <= shard_bytes
    assert all(v == shard_bytes for v in plan.recv_bytes().values())


@given(st.data())
def test_plans_between_real_framework_layouts_reproduce_the_destination(data):
    """FSDP2 (stacked MoE experts), Megatron (fused, padded, pipelined) and inference
    layouts of random tiny models: executing the plan gives exactly the destination."""
    from areal_fn import ParallelDims, fsdp2_layout, inference_layout
    from areal_fn.plans.convert import to_megatron
    from areal_fn.testing.layouts import megatron_layouts_for
    from areal_fn.testing.models import model_specs

    model = data.draw(model_specs())
    choices = {
        "fsdp2": lambda: fsdp2_layout(model, ParallelDims(dp=data.draw(st.integers(1, 3)))),
        "megatron": lambda: data.draw(megatron_layouts_for(model, max_world=6)),
        "inference": lambda: inference_layout(model, ParallelDims(dp=data.draw(st.integers(1, 2)))),
    }
    if model.family.megatron_refusal:  # olmo3, gemma3_text: no Megatron layout
        del choices["megatron"]
    src = choices[data.draw(st.sampled_from(sorted(choices)))]()
    dst = choices[data.draw(st.sampled_from(sorted(choices)))]()
    g = torch.Generator().manual_seed(3)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    offset = src.world_size
    plan = plan_transfers(
        src, dst, src_ranks=range(src.world_size), dst_ranks=range(offset, offset + dst.world_size)
    )
    src_t = {r: to_megatron(canon, src, r) for r in range(src.world_size)}
    dst_t = {
        offset + j: {lt.name: torch.zeros(lt.shape) for lt in dst.local_tensors(j)}
        for j in range(dst.world_size)
    }
    # gpt-oss experts under Megatron are strided: the plan indexes views of them
    apply_transfers(
        plan.transfers, src_t, dst_t, src_views=plan.src_views, dst_views=plan.dst_views
    )
    for j in range(dst.world_size):
        want = to_megatron(canon, dst, j)
        for name, t in want.items():
            assert torch.equal(dst_t[offset + j][name], t), (j, name)
    assert plan.bytes_total == transfer_lower_bound(
        src, dst, src_ranks=range(src.world_size), dst_ranks=range(offset, offset + dst.world_size)
    )


TINY_MOE = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 80,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "tie_word_embeddings": False,
}


@given(st.sampled_from([64, 1024, 1500]), st.booleans())
def test_buckets_smaller_than_an_expert_piece_keep_fsdp2_stacked_experts_intact(max_bytes, back):
    """FSDP2 stacks experts (``mlp.experts.gate_up_proj [E, 2I, H]``): a split must cut the
    local dim that carries the canonical dim, not the expert axis in front of it."""
    from areal_fn import ParallelDims, fsdp2_layout, inference_layout, model_from_hf_config
    from areal_fn.plans.convert import to_megatron

    model = model_from_hf_config(TINY_MOE)
    a = fsdp2_layout(model, ParallelDims(dp=2))
    b = inference_layout(model, ParallelDims(tp=2))
    src, dst = (b, a) if back else (a, b)
    plan = plan_transfers(src, dst, src_ranks=range(2), dst_ranks=range(2, 4))
    buckets = bucket(plan, max_bytes, version=1)
    assert all(0 < bk.nbytes <= max_bytes for bk in buckets.buckets)
    g = torch.Generator().manual_seed(5)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    src_t = {r: to_megatron(canon, src, r) for r in range(2)}
    dst_t = {
        2 + j: {lt.name: torch.zeros(lt.shape) for lt in dst.local_tensors(j)} for j in range(2)
    }
    apply_transfers(buckets.transfers, src_t, dst_t)
    for j in range(2):
        for name, t in to_megatron(canon, dst, j).items():
            assert torch.equal(dst_t[2 + j][name], t), (j, name)


TINY_TIED_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,  # padded to 128 by the engines: 64 rows per TP rank, 36 of padding on rank 1
    "tie_word_embeddings": True,
}


def _sync_tied_head(model, src, dst):  # type: ignore[no-untyped-def]
    """Execute the plan src -> dst; return each last-stage rank's ``lm_head.weight`` with
    the embedding rows it must hold (from its pieces)."""
    from areal_fn.plans.convert import to_megatron

    g = torch.Generator().manual_seed(7)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    offset = src.world_size
    plan = plan_transfers(
        src, dst, src_ranks=range(src.world_size), dst_ranks=range(offset, offset + dst.world_size)
    )
    src_t = {r: to_megatron(canon, src, r) for r in range(src.world_size)}
    dst_t = {
        offset + j: {lt.name: torch.full(lt.shape, float("nan")) for lt in dst.local_tensors(j)}
        for j in range(dst.world_size)
    }
    apply_transfers(
        plan.transfers, src_t, dst_t, src_views=plan.src_views, dst_views=plan.dst_views
    )
    mesh = dst.meshes[0]
    last = mesh.axis_size("pp") - 1
    out = []
    for j in range(dst.world_size):
        if mesh.coords(j)[mesh.axis_index("pp")] != last:
            continue
        assert "lm_head.weight" in dst_t[offset + j], f"last-stage rank {j} holds no tied head"
        (lt,) = [t for t in dst.local_tensors(j) if t.name == "lm_head.weight"]
        got = dst_t[offset + j]["lm_head.weight"]
        for p in lt.pieces:
            if p.canonical is None:
                continue  # padding rows: not sent, left as the receiver has them
            assert p.canonical == "model.embed_tokens.weight" and p.canonical_box is not None
            want = canon["model.embed_tokens.weight"][p.canonical_box.slices()]
            assert torch.equal(got[p.local_box.slices()], want), j
        out.append(j)
    return out


@pytest.mark.parametrize("src_kind", ["fsdp2:d2", "megatron:t2p3", "megatron:d2", "inference:t2"])
def test_weight_sync_refreshes_the_last_stages_tied_head(src_kind):
    """A tied model served with p > 1: the engines hold the embedding on the last
    pipeline rank as the output layer; after the plan runs it equals the canonical
    embedding (rows and TP split of the 64-padded vocabulary) on every last-stage rank."""
    from areal_fn import (
        ParallelDims,
        fsdp2_layout,
        inference_layout,
        megatron_layout,
        model_from_hf_config,
    )

    model = model_from_hf_config(TINY_TIED_LLAMA)
    dims = {
        "fsdp2:d2": lambda: fsdp2_layout(model, ParallelDims(dp=2)),
        "megatron:t2p3": lambda: megatron_layout(model, ParallelDims(tp=2, pp=3)),
        "megatron:d2": lambda: megatron_layout(model, ParallelDims(dp=2)),
        "inference:t2": lambda: inference_layout(model, ParallelDims(tp=2)),
    }
    dst = inference_layout(model, ParallelDims(dp=2, pp=3, tp=2))
    assert _sync_tied_head(model, dims[src_kind](), dst) == [4, 5, 10, 11]


@given(st.data())
def test_weight_sync_refreshes_tied_heads_of_random_models(data):
    from areal_fn import ParallelDims, fsdp2_layout, inference_layout, model_from_hf_config
    from areal_fn.testing.layouts import inference_dims_for, megatron_layouts_for
    from areal_fn.testing.models import hf_configs

    cfg = data.draw(hf_configs())
    cfg["tie_word_embeddings"] = True
    cfg["num_hidden_layers"] = max(2, int(cfg["num_hidden_layers"]))  # type: ignore[call-overload]
    model = model_from_hf_config(cfg)
    dims = data.draw(inference_dims_for(model, max_world=8, min_pp=2))
    dst = inference_layout(model, dims)
    src = data.draw(
        st.sampled_from(
            [
                lambda: fsdp2_layout(model, ParallelDims(dp=2)),
                lambda: data.draw(megatron_layouts_for(model, max_world=4)),
            ][: 1 if model.family.megatron_refusal else 2]
        )
    )()
    assert len(_sync_tied_head(model, src, dst)) == dims.dp * dims.tp
