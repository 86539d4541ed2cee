"""Real FSDP2 (+TP, +HSDP) on transformers models against ``fsdp2_layout``'s predictions.

One ``torchrun --nproc-per-node 4`` launch (``fsdp2_worker.py``) applies
:func:`areal_fn.runtime.engines.fsdp2_apply.apply_fsdp2` to tiny qwen2 / qwen3 / llama (tied and
untied, with biases) models under ``fsdp:d4``, ``fsdp:d2t2``, HSDP 2x2 and ``fsdp:t4``,
and to a qwen3_moe model under ``fsdp:d4`` and ``fsdp:d2t2``, and records, for every
parameter on every rank, whether the DTensor it holds matches the layout (mesh,
placements, local shape, local bytes); then ``load_canonical`` / ``export_canonical``
round trips, logits against the unsharded model, and one SGD step under ``fsdp:d2t2``
against a single-process reference. The tests below read those records.

The JSON goes to a temporary directory of the session (pytest's ``tmp_path_factory``).
"""

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs transformers", allow_module_level=True)

from areal_fn.errors import LayoutError, SpecError
from areal_fn.runtime.launch import run_torchrun
from tests.distributed import fsdp2_worker as worker

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("fsdp2_oracle")]

WORKER = Path(__file__).with_name("fsdp2_worker.py")
REPO = Path(__file__).resolve().parents[2]
WORLD = worker.WORLD


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp2_oracle")
    result = run_torchrun(
        WORKER, ["--out", str(out)], nproc=WORLD, timeout_s=1200, cwd=REPO, check=False
    )
    recs = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.exists(), result.report()
        recs.append(json.loads(path.read_text()))
    assert result.ok or any(rec["failures"] for rec in recs), result.report()
    return recs


def _hf_param_names(config: str) -> list[str]:
    """``named_parameters()`` and the persistent buffers ``state_dict()`` saves (GLM's
    router bias) of the transformers model (meta device): the ground truth."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in worker.CONFIGS[config].items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(worker.CONFIGS[config]["model_type"], **cfg)
        )
    stored = set(model.state_dict())
    buffers = [n for n, _ in model.named_buffers() if n in stored]
    return sorted([n for n, _ in model.named_parameters()] + buffers)


def test_no_check_failed(records: list[dict[str, Any]]) -> None:
    for rec in records:
        assert rec["world_size"] == WORLD
        assert rec["failures"] == [], json.dumps(rec["failures"][:5], indent=1)


def test_every_parameter_of_every_case_was_checked(records: list[dict[str, Any]]) -> None:
    names = {c: _hf_param_names(c) for c in worker.CONFIGS}
    expected = sum(len(names[c]) for c, _ in worker.LAYOUT_CASES)
    for rec in records:
        assert sorted(rec["params"]) == sorted(f"{c}/{s}" for c, s in worker.LAYOUT_CASES)
        for case, params in rec["params"].items():
            assert params == names[case.split("/")[0]], case
        counts = rec["counts"]
        assert counts["layout.cases"] == len(worker.LAYOUT_CASES)
        buffers = counts.get("layout.buffers", 0)  # checked whole (layout.buffer)
        assert counts["layout.params"] + buffers == expected
        assert counts.get("layout.buffer.checked", 0) == buffers
        for check in (
            "placements",
            "mesh",
            "mesh_ranks",
            "global_shape",
            "local_shape",
            "local_data",
            "local_data_shard",
            "full_tensor",
        ):
            assert counts[f"layout.{check}.checked"] == expected - buffers, check
        assert counts["load.local_data.checked"] == expected
        assert counts["export.tensors"] == counts["export.data.checked"]
        assert counts["forward.logits.checked"] == len(worker.LAYOUT_CASES)
        assert counts["train.cases"] == len(worker.TRAIN_CASES)
        # every axis of the three distinct meshes plus t4's
        assert counts["groups.mine.checked"] == counts["groups.all.checked"] == 7


def test_recorded_placements_cover_the_vocabulary_of_fsdp2(records: list[dict[str, Any]]) -> None:
    seen = {
        tuple(p["placements"]) for case in records[0]["placements"].values() for p in case.values()
    }
    assert ("S(0)",) in seen  # plain FSDP
    assert ("R", "S(0)") in seen  # HSDP
    assert ("SS(0,2)", "S(0)") in seen  # FSDP over column-wise TP
    assert ("SS(0,4)", "S(0)") in seen  # t4: dp_shard of size 1 still records the stride
    assert ("S(0)", "S(1)") in seen  # FSDP over row-wise TP
    assert ("S(0)", "R") in seen  # norms, biases of row-wise layers, experts, router
    emb = records[0]["placements"]["llama_tied/d2t2_rep_emb"]["model.embed_tokens.weight"]
    assert emb["placements"] == ["S(0)", "R"]  # tp_embeddings=False


def test_uneven_vocabulary_is_exercised(records: list[dict[str, Any]]) -> None:
    # vocab 50 over 4 ranks chunks like torch.chunk: 13, 13, 13, 11
    assert worker.CONFIGS["qwen2"]["vocab_size"] == 50
    shapes = [
        rec["placements"]["qwen2/d4"]["model.embed_tokens.weight"]["local_shape"] for rec in records
    ]
    assert shapes == [[13, 32], [13, 32], [13, 32], [11, 32]]
    # t4: the vocabulary-parallel embedding is uneven over tp
    shapes = [
        rec["placements"]["qwen2/t4"]["model.embed_tokens.weight"]["local_shape"] for rec in records
    ]
    assert shapes == [[13, 32], [13, 32], [13, 32], [11, 32]]


def test_without_replicate_parallel_fsdp2_leaves_plain_parameters_on_the_dp_mesh(
    records: list[dict[str, Any]],
) -> None:
    # Why the runtime turns replicated parameters into Replicate() DTensors: otherwise
    # FSDP2 puts them on the 1-D dp_shard mesh, unlike the (dp_shard, tp) layout mesh.
    for rec in records:
        seen = rec["observations"]["plain_replicated_qwen3_moe/d2t2"]
        roles = {n.split(".", 3)[-1] for n in seen}
        assert {
            "input_layernorm.weight",
            "self_attn.q_norm.weight",
            "mlp.gate.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        } <= roles, roles
        assert "model.norm.weight" in seen
        for name, got in seen.items():
            assert got["mesh"] == ["dp_shard"] and got["placements"] == ["S(0)"], name


def test_training_step_matches_single_process(records: list[dict[str, Any]]) -> None:
    for rec in records:
        for case, diff in rec["measured"]["train_weight_max_abs_diff"].items():
            _, grad_atol, weight_atol = worker.RUN_OPTIONS[case.split("/")[2]]
            assert diff <= weight_atol, case
            assert rec["measured"]["train_grad_max_abs_diff"][case] <= grad_atol, case
        fp32 = [
            d
            for c, d in rec["measured"]["train_weight_max_abs_diff"].items()
            if c.endswith("/fp32")
        ]
        expected = sum(1 for c in worker.TRAIN_CASES if c[2] == "fp32")
        assert len(fp32) == expected == 15 and max(fp32) <= 1e-6


def test_logits_match_unsharded_model(records: list[dict[str, Any]]) -> None:
    for rec in records:
        diffs = rec["measured"]["logits_max_abs_diff"]
        assert len(diffs) == len(worker.LAYOUT_CASES)
        for case, diff in diffs.items():
            assert diff <= worker.LOGITS_ATOL_OF.get(case.split("/")[0], worker.LOGITS_ATOL), case
            if "/d4" in case or "/hsdp" in case:
                assert diff == 0.0, case  # no TP: the same arithmetic in the same order


# -- no processes needed ----------------------------------------------------------------


def test_tp_plan_follows_the_layout() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from areal_fn.runtime.engines.fsdp2_apply import ReplicateParallel, tp_plan

    spec, layout = worker.layout_for("llama_untied", "d2t2")
    plan = tp_plan(worker.build_model(spec, seed=0), layout)
    kinds = {name: type(style).__name__ for name, style in plan.items()}
    assert kinds["model.embed_tokens"] == RowwiseParallel.__name__
    assert kinds["model.layers.0.self_attn.q_proj"] == ColwiseParallel.__name__
    assert kinds["model.layers.0.self_attn.o_proj"] == RowwiseParallel.__name__
    assert kinds["model.layers.1.mlp.down_proj"] == RowwiseParallel.__name__
    assert kinds["model.norm"] == ReplicateParallel.__name__
    assert kinds["lm_head"] == ColwiseParallel.__name__
    assert len(plan) == 1 + 2 * 9 + 2  # embed, 7 linears + 2 norms per layer, norm, lm_head

    spec, layout = worker.layout_for("qwen3", "t4")
    plan = tp_plan(worker.build_model(spec, seed=0), layout)
    q_norm = plan["model.layers.0.self_attn.q_norm"]
    assert isinstance(q_norm, ReplicateParallel) and q_norm.partial_grads
    assert not plan["model.layers.0.input_layernorm"].partial_grads  # type: ignore[attr-defined]

    spec, layout = worker.layout_for("llama_tied", "t4")
    plan = tp_plan(worker.build_model(spec, seed=0), layout)
    assert "lm_head" in plan  # tied: styled through the embedding's placement

    spec, layout = worker.layout_for("qwen2", "d4")
    assert tp_plan(worker.build_model(spec, seed=0), layout) == {}


def test_run_options_reject_unknown_dtypes() -> None:
    from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions

    with pytest.raises(SpecError, match=r"param_dtype=.fp8. is not one of"):
        Fsdp2RunOptions(param_dtype="fp8")


def test_tp_plan_refuses_a_layout_of_another_model() -> None:
    from areal_fn.runtime.engines.fsdp2_apply import tp_plan

    spec, _ = worker.layout_for("qwen2", "d2t2")
    _, other = worker.layout_for("qwen3", "d2t2")
    with pytest.raises(LayoutError, match=r"are not in the fsdp2 layout"):
        tp_plan(worker.build_model(spec, seed=0), other)
