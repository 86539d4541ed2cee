"""Laws of inference layouts: where the engines hold each weight, tied embeddings included.

With ``tie_word_embeddings`` and ``p > 1``, vLLM and SGLang hold the embedding twice:
on the first pipeline rank as ``embed_tokens`` and on the last as the output layer
(``lm_head``), both vocab-padded to 64 and split evenly over TP. Weight sync must
refresh both copies, so the layout lists both.
"""

import functools
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.testing.models import hf_configs

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
EMBED = "model.embed_tokens.weight"


@functools.cache
def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


def stage_ranks(layout: Layout, stage: int) -> list[int]:
    mesh = layout.meshes[0]
    return [r for r in range(layout.world_size) if mesh.coords(r)[mesh.axis_index("pp")] == stage]


def embedding_rows(layout: Layout, rank: int) -> dict[str, tuple[int, int]]:
    """Local tensor name -> the embedding rows it holds on ``rank``."""
    out = {}
    for lt in layout.local_tensors(rank):
        boxes = [p.canonical_box for p in lt.pieces if p.canonical == EMBED]
        if boxes:
            assert len(boxes) == 1 and boxes[0] is not None
            out[lt.name] = boxes[0].ranges[0]
    return out


def test_qwen2_5_0_5b_p2t2_holds_the_tied_embedding_on_both_stages():
    model = spec("Qwen2.5-0.5B")  # tie_word_embeddings: true, vocab 151936 = 2374 * 64
    layout = inference_layout(model, ParallelDims(pp=2, tp=2))
    half = 151936 // 2
    for stage, name in ((0, EMBED), (1, "lm_head.weight")):
        for r, rows in zip(stage_ranks(layout, stage), ((0, half), (half, 151936)), strict=True):
            assert embedding_rows(layout, r) == {name: rows}, (stage, r)
            (lt,) = [t for t in layout.local_tensors(r) if t.name == name]
            assert lt.shape == (half, 896)


def test_untied_or_single_stage_models_hold_the_embedding_once():
    untied = inference_layout(spec("Qwen2.5-7B"), ParallelDims(pp=2, tp=2))
    assert all(embedding_rows(untied, r) == {} for r in stage_ranks(untied, 1))
    single = inference_layout(spec("Qwen2.5-0.5B"), ParallelDims(tp=2))  # the engines alias it
    for layout in (untied, single):
        for r in stage_ranks(layout, 0):
            assert set(embedding_rows(layout, r)) == {EMBED}


@st.composite
def tied_pipelines(draw):  # type: ignore[no-untyped-def]
    """A tiny model, tied or not, and inference degrees with ``p > 1`` most of the time."""
    from areal_fn.testing.layouts import inference_dims_for

    cfg = draw(hf_configs())
    cfg["tie_word_embeddings"] = draw(st.booleans())
    cfg["num_hidden_layers"] = max(2, int(cfg["num_hidden_layers"]))  # type: ignore[call-overload]
    model = model_from_hf_config(cfg)
    min_pp = draw(st.sampled_from([2, 1]))
    return model, draw(inference_dims_for(model, max_world=8, min_pp=min_pp))


@given(tied_pipelines())
def test_each_stage_holds_what_the_engines_hold(case):
    """The embedding is on stage 0; with tied embeddings and ``p > 1`` also on the last
    stage, as ``lm_head.weight``, padded and split exactly like the embedding (same rows
    and local shape at the same ``(dp, tp)`` coordinates), holding the canonical rows."""
    model, dims = case
    layout = inference_layout(model, dims)
    last = dims.pp - 1
    tied_copy = model.tie_word_embeddings and dims.pp > 1
    names = {lt.name for r in range(layout.world_size) for lt in layout.local_tensors(r)}
    assert ("lm_head.weight" in names) == (tied_copy or not model.tie_word_embeddings)
    first, final = stage_ranks(layout, 0), stage_ranks(layout, last)
    for stage in range(1, last):
        assert all(embedding_rows(layout, r) == {} for r in stage_ranks(layout, stage))
    covered = set()
    for a, b in zip(first, final, strict=True):  # same (dp, tp) coordinates
        here = embedding_rows(layout, a)
        assert set(here) <= {EMBED}
        covered |= {tuple(v) for v in here.values()}
        (ea,) = [t for t in layout.local_tensors(a) if t.name == EMBED]
        if not tied_copy:
            assert embedding_rows(layout, b) == (here if dims.pp == 1 else {})
            continue
        there = embedding_rows(layout, b)
        assert set(there) <= {"lm_head.weight"}
        assert here.get(EMBED) == there.get("lm_head.weight"), (a, b)
        (lb,) = [t for t in layout.local_tensors(b) if t.name == "lm_head.weight"]
        assert ea.shape == lb.shape
        assert [p.local_box for p in ea.pieces] == [p.local_box for p in lb.pieces]
    assert sum(hi - lo for lo, hi in covered) == model.vocab_size  # every row, once per replica
    # materialising the last stage's copy gives the canonical embedding rows
    if tied_copy:
        g = torch.Generator().manual_seed(0)
        canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
        for r in final:
            got = to_megatron(canon, layout, r)["lm_head.weight"]
            lo, hi = embedding_rows(layout, r).get("lm_head.weight", (0, 0))
            assert torch.equal(got[: hi - lo], canon[EMBED][lo:hi])
            assert bool((got[hi - lo :] == 0).all())  # vocabulary padding rows


@given(st.data())
def test_gpt_oss_experts_and_sinks_split_as_the_engines_load_them(data):
    """vLLM's gpt-oss loader (SGLang's likewise): rank ``r`` of ``tp`` takes
    ``gate_up_proj[:, :, 2*r*I/tp : 2*(r+1)*I/tp]`` (interleaved gate/up columns),
    ``gate_up_proj_bias[:, 2*r*I/tp : ...]``, ``down_proj[:, r*I/tp : (r+1)*I/tp, :]``,
    the sinks of its heads, and the whole ``down_proj_bias`` and router."""
    from areal_fn.testing.layouts import inference_dims_for
    from areal_fn.testing.models import model_specs

    model = data.draw(model_specs("gpt_oss", max_layers=2))
    dims = data.draw(inference_dims_for(model, max_world=4))
    layout = inference_layout(model, dims)
    g = torch.Generator().manual_seed(0)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    inter, heads, tp = model.moe_intermediate_size, model.num_attention_heads, dims.tp
    for rank in range(layout.world_size):
        r = layout.meshes[0].coords(rank)[-1]
        local = to_megatron(canon, layout, rank)
        for name, t in local.items():
            if ".mlp." not in name and not name.endswith("sinks"):
                continue
            c, i, h = canon[name], inter // tp, heads // tp
            role = name.split(".", 3)[3]
            if role == "self_attn.sinks":
                want = c[r * h : (r + 1) * h]
            elif role == "mlp.experts.gate_up_proj":
                want = c[:, :, 2 * r * i : 2 * (r + 1) * i]
            elif role == "mlp.experts.gate_up_proj_bias":
                want = c[:, 2 * r * i : 2 * (r + 1) * i]
            elif role == "mlp.experts.down_proj":
                want = c[:, r * i : (r + 1) * i, :]
            else:  # down_proj_bias, router weight and bias: whole
                want = c
            assert torch.equal(t, want), name
