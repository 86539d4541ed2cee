"""Gradient-equivalence law: one AdamW step of every engine equals the plain model's.

One ``torchrun --nproc-per-node 4`` launch (``grad_worker.py``) runs, for tiny qwen2,
qwen3 and tied llama models, one optimizer step (AdamW, fixed lr, fp32, gradients clipped
to norm 0.5) of :class:`~areal_fn.runtime.engines.fsdp2.Fsdp2Engine` under ``fsdp:d4``,
``fsdp:d2t2`` (also with activation checkpointing and CPU offload) and HSDP (dp 4 = 2 replicas x 2 shards), and of
:class:`~areal_fn.runtime.engines.megatron.MegatronEngine` under ``megatron:d2t2``,
``d2p2``, ``t2p2``, ``d2p2v2`` (interleaved) and an uneven ``d2p2`` split (1 + 3
layers), each from the same canonical weights (``load_canonical``) on the same global
batch split evenly over the data-parallel ranks, against a single-process step of the
transformers model on the whole batch with ``torch.optim.AdamW``.

Every data-parallel share has the same number of target tokens, except in the
``+mask`` cases: there a loss mask keeps 3 to 15 targets per row, so the shares hold
different counts, and the reference is the masked mean over the whole batch; the
engines all-reduce the counts, so their loss is the same global token mean.

Ulysses sequence parallelism (``fsdp:d2c2``, ``fsdp:t2c2``, ``c`` with HSDP): every
rank of a sequence-parallel group gets the same rows, and hooks on the embedding and
the first attention layer record that each rank ran ``T/cp`` tokens; mixtral under
``t2c2`` has one KV head per TP rank, repeated for ``cp=2``. The ``+pack`` case trains
on sequences of 3 to 16 tokens (2 prompt tokens that are not targets, per-token
weights) packed into rows of at most 16 tokens, against the plain model run on each
sequence alone: packed equals one by one, log-probs included. The gated-delta-net
families pack too (``qwen3_next/fsdp:d4+pack``, ``qwen3_5_moe_text/hsdp:d4r2+pack``, rows
of at most 32 tokens: two sequences of different lengths in every row of every rank),
their linear-attention layers run on each sequence alone.

Megatron context parallelism (``megatron:d2c2``, ``t2c2``, ``p2c2`` on packed sequences,
and ``d2c2e2`` for deepseek_v3: multi-latent attention with experts): each CP rank holds
chunks ``r`` and ``3 - r`` of the 4 chunks of a row, and hooks on the embedding and
the first attention layer of every chunk record that each rank ran ``T/cp`` tokens.

fp16 with a dynamic loss scale (``+fp16`` cases, ``fp16_cases.py``): six steps of each
engine (``fsdp:d4``, ``fsdp:d2t2``, ``fsdp:t2c2``, ``megatron:d2t2``, ``megatron:d2p2``,
``megatron:d2c2``; mixtral under ``fsdp:d4``) against one
process running the same steps under ``torch.autocast("cpu", dtype=torch.float16)`` with
``torch.amp.GradScaler("cpu")``; two of them overflow on purpose (a huge token weight
on one share; an inf written into one rank's gradients only).

The pure helpers the engines share are tested at the end (no launch).
"""

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs megatron-core and transformers", allow_module_level=True)

import torch

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import Fsdp2Options, fsdp2_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.pipeline.partition import StagePlan, megatron_layout_string
from areal_fn.runtime.engines.common import (
    AdamWConfig,
    canonical_multiplicity,
    next_token_targets,
    norm_weights,
    split_rows,
)
from areal_fn.runtime.launch import run_torchrun
from areal_fn.strategy.allocation import ParallelDims
from tests.distributed import fp16_cases as fp16
from tests.distributed import grad_worker as worker

WORKER = Path(__file__).with_name("grad_worker.py")
REPO = Path(__file__).resolve().parents[2]

# Tolerances (fp32). Observed on CPU/gloo, torch 2.13, megatron-core 0.16.1:
LOSS_ATOL = 1e-5  # loss: <= 5.7e-7 (loss ~ 4.1)
NORM_RTOL = 1e-5  # grad norm, relative: <= 6.5e-8
GRAD_RTOL = 1e-5  # clipped gradients, max abs diff / max |reference grad|: <= 7.7e-7
# Updated weights: AdamW's first step is lr * g / (|g| + eps), whose derivative
# lr * eps / (|g| + eps)^2 amplifies rounding of near-zero gradients: up to 1.7e-5
# (deepseek_v3 megatron, at an element whose reference gradient is 4.6e-9; 4.0e-6 for
# qwen3 fsdp:d2t2 at 1.5e-8), a figure that moves with the machine's kernels. So the
# law bounds what the measured gradient difference does not explain (the worker's
# unexplained_weight_diff: a few float32 ulps of the weights), and, where |g| >= 1e-6,
# the difference itself.
WEIGHT_CONDITIONED_ATOL = 1e-6
LOGPROB_ATOL = 1e-5  # log-probs after the step: <= 9.5e-7
# gemma3_text multiplies its embedding by sqrt(hidden_size) (4 here), and the amplified
# rounding above lands on the embedding (1.4e-5 at an element whose reference gradient
# is 9.9e-8): its log-probs after the step differ by up to 1.4e-4 (fsdp:d2t2, t2c2);
# before the step (the loss) by 1.9e-7
# qwen3_next (gated delta net, (1 + w) norms, gated shared expert): up to 1.03e-5 after
# the step (fsdp:d4; 3.3e-6 packed), its loss before the step by 7.0e-7
# qwen3_5_moe_text under fsdp:d2t2 (its linear-attention layers on each rank's key-head
# groups): 2.6e-5 after the step, its loss before the step by 9.5e-8
LOGPROB_ATOL_OF = {"gemma3_text": 5e-4, "qwen3_next": 5e-5, "qwen3_5_moe_text": 5e-5}
# Megatron-Core's GatedDeltaNet against transformers' module (two implementations of the
# delta rule, its conv and their backward): this model's gradients grow towards the input
# (layer 0's are 10^2 to 10^4 times the last layer's), and the rounding differences grow
# with them. Observed: qwen3_next megatron:d2p2 gradients 1.0e-5 (of the largest), norm
# 1.2e-6, log-probs 2.1e-5; qwen3_5_text megatron:d2t2 gradients 7.4e-6, norm 5.3e-5,
# log-probs 1.3e-5 (at tp=1, in one process, the same weights: norm 1.9e-6). The bound
# still catches a gated norm whose gradient is not summed over TP (1.4e-2).
GATED_DELTA_MEGATRON = ("qwen3_next/megatron:d2p2", "qwen3_5_text/megatron:d2t2")
GATED_DELTA_RTOL = 2e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("grad_equivalence")
    result = run_torchrun(
        WORKER, ["--out", str(out)], nproc=worker.WORLD, timeout_s=1200, cwd=REPO, check=False
    )
    path = out / "results.json"
    assert path.exists(), result.report()
    data: dict[str, Any] = json.loads(path.read_text())
    assert result.ok, result.report()
    return data


def _case_ids() -> list[str]:
    return [f"{c}/{s}" for c, s in worker.CASES]


@pytest.mark.parametrize("case", _case_ids())
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("grad_equivalence")
def test_one_step_equals_the_plain_model(results: dict[str, Any], case: str) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    assert rec["rank_errors"] == [None] * worker.WORLD, rec["rank_errors"]
    assert rec["world"] == worker.WORLD
    assert rec["load_export_bitwise"], "load_canonical -> export_canonical is not bitwise"
    full = worker.BATCH * (worker.SEQ - 1)
    assert rec["tokens"] == rec["ref_tokens"]
    if not case.endswith(worker.PACKED):
        assert (rec["tokens"] < full) == case.endswith(worker.MASKED)
    assert rec["lr"] == worker.ADAMW.lr
    assert rec["clip_coef"] < 1.0, "the test is meant to exercise clipping"
    assert rec["loss_abs_diff"] <= LOSS_ATOL, rec
    gated_delta = case in GATED_DELTA_MEGATRON
    assert rec["grad_norm_rel_diff"] <= (GATED_DELTA_RTOL if gated_delta else NORM_RTOL), rec
    assert rec["grad_rel_diff"] <= (GATED_DELTA_RTOL if gated_delta else GRAD_RTOL), rec
    assert rec["weight_unexplained"] <= WEIGHT_CONDITIONED_ATOL, rec
    assert rec["weight_max_abs_diff_conditioned"] <= WEIGHT_CONDITIONED_ATOL, rec
    assert rec["weight_step"] > 0.5 * worker.ADAMW.lr, "the reference step moved nothing"
    logprob_atol = LOGPROB_ATOL_OF.get(case.split("/")[0], LOGPROB_ATOL)
    assert rec["logprob_max_abs_diff"] <= (GATED_DELTA_RTOL if gated_delta else logprob_atol)
    assert rec["optimizer_created_zero"] and rec["optimizer_names_ok"], rec
    assert rec["optimizer_shapes_ok"] and rec["optimizer_steps"] == [1.0], rec
    # only the DSA families' indexers get no gradient (their top-k is not differentiable
    # in transformers' module, the reference): they keep a zero state, as they have no
    # gradient in the reference either
    indexer = model_from_hf_config(worker.CONFIGS[case.split("/")[0]]).family.indexer
    assert bool(rec["optimizer_untrained"]) == bool(indexer), rec["optimizer_untrained"]
    assert all(".indexer." in n for n in rec["optimizer_untrained"]), rec["optimizer_untrained"]
    assert rec["untrained_have_no_ref_grad"], rec["optimizer_untrained"]


_SP_CASES = [  # the FSDP2 engine's Ulysses cases
    c for c in _case_ids() if c.split("/")[1].startswith(("fsdp", "hsdp")) and "c2" in c
]


@pytest.mark.parametrize("case", _SP_CASES)
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("grad_equivalence")
def test_each_sequence_parallel_rank_runs_its_share_of_tokens(
    results: dict[str, Any], case: str
) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    assert rec["sp"] == 2 and rec["dp_size"] * rec["sp"] * (2 if "t2" in case else 1) == 4
    for seen in rec["tokens_seen"]:  # embedding and layer-0 attention, step and log-probs
        assert seen, "no forward ran on a rank"
        if case.endswith(worker.PACKED):
            assert max(seen) <= worker.PACKED_BUDGET // 2, seen
        else:
            assert set(seen) == {worker.SEQ // 2}, seen
    assert re.match(
        r"^rows of 15 tokens do not split over cp=2 sequence-parallel ranks; pad rows to a "
        r"multiple of 2 \(loss_mask False\) or use train_step_packed$",
        rec["odd_length_error"],
    ), rec["odd_length_error"]
    if case.endswith(worker.PACKED):  # both ranks of a sequence-parallel group: same rows
        per_rank = rec["tokens_seen"]
        assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
        assert per_rank[0] != per_rank[2], "data-parallel shares were meant to differ"


_CP_CASES = [  # the Megatron engine's context-parallel cases
    c for c in _case_ids() if c.split("/")[1].startswith("megatron") and "c2" in c
]


@pytest.mark.parametrize("case", _CP_CASES)
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("grad_equivalence")
def test_each_context_parallel_rank_runs_t_over_cp_tokens(
    results: dict[str, Any], case: str
) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    # every row (padded: SEQ tokens; packed: the widest row, a full budget) in 2*cp
    # chunks, two per rank: every embedding and attention layer sees half of it
    width = worker.PACKED_BUDGET if case.endswith(worker.PACKED) else worker.SEQ
    for seen in rec["tokens_seen"]:  # embedding (first stage), layer-0 attention per chunk
        assert seen and set(seen) == {width // 2}, seen


def test_cp_cases_are_in_the_launch() -> None:
    assert set(_CP_CASES) == {
        "qwen2/megatron:d2c2",
        "qwen2/megatron:t2c2",
        "qwen2/megatron:p2c2+pack",
        "deepseek_v3/megatron:d2c2e2",
    }


#: The gated-delta-net families' packed cases (``linear_packed``).
_LINEAR_PACKED = ["qwen3_next/fsdp:d4+pack", "qwen3_5_moe_text/hsdp:d4r2+pack"]


def test_linear_attention_packed_cases_are_in_the_launch() -> None:
    assert set(_LINEAR_PACKED) <= set(_case_ids())


@pytest.mark.parametrize("case", _LINEAR_PACKED)
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("grad_equivalence")
def test_linear_attention_rows_pack_several_sequences(results: dict[str, Any], case: str) -> None:
    """Every row of every rank holds two sequences, so the law above is about packing."""
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    assert rec["sequences_per_row"] == [[2]] * worker.WORLD, rec["sequences_per_row"]


def test_gated_delta_megatron_cases_are_in_the_launch() -> None:
    assert set(GATED_DELTA_MEGATRON) <= set(_case_ids())


def test_sp_cases_are_in_the_launch() -> None:
    labels = {label for _, label in worker.CASES}
    assert {"fsdp:d2c2", "fsdp:t2c2", "hsdp:d2r2c2+pack"} <= labels


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("grad_equivalence")
def test_every_case_ran(results: dict[str, Any]) -> None:
    assert sorted(results["cases"]) == sorted(_case_ids() + _fp16_ids())
    assert results["world_size"] == worker.WORLD
    lines = [
        f"{case:30s} loss {r['loss_abs_diff']:.1e}  norm(rel) {r['grad_norm_rel_diff']:.1e}  "
        f"grad(rel) {r['grad_rel_diff']:.1e}  weights {r['weight_max_abs_diff']:.1e} "
        f"({r['weight_max_abs_diff_conditioned']:.1e} where |g| >= 1e-6)  "
        f"logp {r['logprob_max_abs_diff']:.1e}  (worst weight: {r['weight_worst']}, "
        f"|reference grad| there {r['weight_worst_ref_grad']:.1e})"
        for case, r in sorted(results["cases"].items())
        if r["error"] is None and not case.endswith(fp16.FP16)
    ]
    print("\n" + "\n".join(lines))


# ---------------------------------------------------------------- fp16, loss scaling
# What is exact: the scale each step used, which steps were skipped (on every rank),
# the scaler's state after each step (scale, growth tracker), the learning rate, and
# that a skipped step leaves every weight bitwise as it was. What is rounded: fp16
# (unit roundoff u = 2**-11 = 4.9e-4) computes every logit and gradient, in another
# order than the single process (sharded matmuls, FSDP2's reduce-scatter; Megatron's
# fp16 parameters, where autocast casts fp32 ones per op). Observed on CPU/gloo, torch
# 2.13, megatron-core 0.16:
FP16_LOSS_RTOL = 1e-3  # 2u: <= 2.1e-4 (the huge-weight step: one token's CE x 1e8)
FP16_NORM_RTOL = 1e-3  # 2u on the gradient norm: <= 3.6e-4 (an unscaled one: x 512)
# Weights after each step: the distance of the engine's total movement from the AMP
# run's, relative to the AMP run's movement, at most twice that of the same steps in
# float32 (what fp16 rounding alone moves AdamW's sign-like first steps by: 0.7-3.5%).
# FSDP2 computes autocast's own arithmetic: observed 0.19-0.28 times it (fsdp:d4),
# 0.72-0.75 (d2t2, t2c2), 0.00-0.04 (mixtral fsdp:d4); Megatron rounds its parameters to fp16 too (the norms' weights
# included), a second fp16 run beside the AMP one: observed 1.28-1.49 times it.
FP16_MOVEMENT_VS_FP32 = 2.0


def _fp16_ids() -> list[str]:
    return [f"{c}/{s}" for c, s in fp16.FP16_CASES]


@pytest.mark.parametrize("case", _fp16_ids())
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("grad_equivalence")
def test_fp16_steps_equal_torch_amp(results: dict[str, Any], case: str) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    assert rec["rank_errors"] == [None] * worker.WORLD, rec["rank_errors"]
    steps = rec["steps"]
    assert len(steps) == fp16.STEPS
    want = [s == fp16.HUGE_STEP or s == fp16.POISON_STEP for s in range(fp16.STEPS)]
    assert [s["ref_skipped"] for s in steps] == want, "the reference was meant to skip these"
    for i, s in enumerate(steps):
        skipped = float(s["ref_skipped"])
        assert s["skipped_per_rank"] == [skipped] * worker.WORLD, (i, s)
        assert s["loss_scale"] == s["ref_loss_scale"], (i, s)
        assert s["scaler"] == s["ref_scaler"], (i, s)
        assert s["lr"] == s["ref_lr"], (i, s)
        assert s["unchanged"] == s["ref_skipped"], (i, s)
        assert s["loss_rel_diff"] <= FP16_LOSS_RTOL, (i, s)
        if not s["ref_skipped"]:
            rel = abs(s["grad_norm"] - s["ref_grad_norm"]) / s["ref_grad_norm"]
            assert rel <= FP16_NORM_RTOL, (i, s)
            assert s["movement_rel_diff"] <= FP16_MOVEMENT_VS_FP32 * s["control_movement_rel_diff"]
    # the scale grew after two good steps, then backed off at each overflow
    assert [s["loss_scale"] for s in steps] == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 512.0]
    assert rec["optimizer_steps"] == [4.0]  # AdamW stepped on the four good steps only
    # the schedule's state carries the scale (what a checkpoint's lr_scheduler holds)
    assert rec["scheduler_state"] == {
        "steps_done": 4,
        "loss_scale": {"scale": 512.0, "growth_tracker": 1},
    }
    assert rec["resumed"] == [1, fp16.RESUMED]
    assert rec["master_dtypes"] == ["torch.float32"]  # local_state: the fp32 weights
    # the parameters the model computes with: Megatron's fp16, FSDP2's fp32 (autocast)
    fp16_params = case.split("/")[1].startswith("megatron")
    assert rec["model_dtypes"] == ["torch.float16" if fp16_params else "torch.float32"]
    # Megatron's fp16 parameters are its masters rounded, refreshed before a forward
    assert rec["params_are_rounded_masters"] == fp16_params
    assert rec["logprobs_finite"]


def test_fp16_cases_are_in_the_launch() -> None:
    labels = {label for _, label in fp16.FP16_CASES}
    assert {"fsdp:d4+fp16", "fsdp:t2c2+fp16", "megatron:d2p2+fp16", "megatron:d2c2+fp16"} <= labels
    assert fp16.POISONED_RANK != 0 and fp16.HUGE_STEP != fp16.POISON_STEP


# ---------------------------------------------------------------- pure helpers
def _spec(config: str) -> Any:
    return model_from_hf_config(worker.CONFIGS[config])


def test_multiplicity_counts_replicas_and_the_tied_copy() -> None:
    spec = _spec("llama_tied")
    mult = canonical_multiplicity(megatron_layout(spec, ParallelDims(dp=2, pp=2)))
    # embedding on the first stage and its tied copy on the last, each on 2 dp replicas
    assert mult["model.embed_tokens.weight"] == 4
    assert mult["model.layers.0.self_attn.q_proj.weight"] == 2
    assert mult["model.norm.weight"] == 2
    fsdp = canonical_multiplicity(fsdp2_layout(spec, ParallelDims(dp=2, tp=2)))
    assert fsdp["model.embed_tokens.weight"] == 1  # sharded over dp and tp
    assert fsdp["model.norm.weight"] == 2  # replicated over tp
    hsdp = fsdp2_layout(spec, ParallelDims(dp=4), options=Fsdp2Options(hsdp_replicas=2))
    assert set(canonical_multiplicity(hsdp).values()) == {2}


def test_norm_weights_count_each_canonical_element_once() -> None:
    spec = _spec("qwen2")
    layout = megatron_layout(spec, ParallelDims(dp=2, tp=2))
    total = 0.0
    for rank in range(layout.world_size):
        for pieces in norm_weights(layout, rank).values():
            total += sum(box.numel * w for box, w in pieces)
    assert total == pytest.approx(spec.num_params)  # padding rows left out


def test_pipeline_layout_string() -> None:
    """The string the Megatron engine hands to ``TransformerConfig``, as Megatron reads it."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    parse = PipelineParallelLayerLayout.parse_str_to_list
    uneven = StagePlan(costs=(1.0,) * 4, num_stages=2, stage_lengths=(1, 3))
    assert megatron_layout_string(uneven) == "Et|t*3L"
    assert parse(megatron_layout_string(uneven)) == parse("Et|tttL")
    interleaved = StagePlan(costs=(1.0,) * 4, num_stages=2, vpp=2, stage_lengths=(1, 1, 1, 1))
    assert megatron_layout_string(interleaved) == "Et|t|t|tL"


def test_split_rows_refuses_uneven_batches() -> None:
    batch = torch.arange(12).reshape(6, 2)
    assert torch.equal(split_rows(batch, 3, 1), batch[2:4])
    with pytest.raises(SpecError, match=r"6 rows does not split evenly over 4"):
        split_rows(batch, 4, 0)
    with pytest.raises(SpecError, match=r"index=3 must lie in 0\.\.2"):
        split_rows(batch, 3, 3)


def test_next_token_targets() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[True, False, True], [True, True, True]])
    targets, m = next_token_targets(ids, mask)
    assert torch.equal(targets, ids[:, 1:]) and torch.equal(m, mask[:, 1:])
    with pytest.raises(SpecError, match=r"no next token"):
        next_token_targets(ids[:, :1])
    with pytest.raises(SpecError, match=r"loss_mask shape \(2, 2\) differs"):
        next_token_targets(ids, mask[:, :2])


def test_adamw_config_is_validated() -> None:
    assert AdamWConfig().betas == (0.9, 0.999)
    with pytest.raises(SpecError, match=r"AdamWConfig.lr=0 must be a finite number > 0"):
        AdamWConfig(lr=0)
    with pytest.raises(SpecError, match=r"AdamWConfig.betas=\(0.9, 1.0\) must be two numbers"):
        AdamWConfig(betas=(0.9, 1.0))
    with pytest.raises(SpecError, match=r"weight_decay=-1 must be a finite number >= 0"):
        AdamWConfig(weight_decay=-1)


def test_partial_placements_have_no_norm() -> None:
    from areal_fn.layouts.layout import Layout, LogicalTensor
    from areal_fn.sharding.mesh import Mesh
    from areal_fn.sharding.placement import Partial
    from areal_fn.sharding.sharding import Sharding

    spec = _spec("qwen2")
    t = spec.tensors[0]
    bad = Layout(
        kind="fsdp2",
        world_size=2,
        canonical=(t,),
        tensors=(
            LogicalTensor(
                name=t.name,
                shape=t.shape,
                dtype=t.dtype,
                fusion=fsdp2_layout(spec, ParallelDims(dp=2)).tensor(t.name).fusion,
                sharding=Sharding(mesh=Mesh.of(dp=2), placements=(Partial(),)),
            ),
        ),
    )
    with pytest.raises(LayoutError, match=r"placement P on 'dp'; a partial tensor"):
        canonical_multiplicity(bad)
