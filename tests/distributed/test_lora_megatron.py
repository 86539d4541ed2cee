"""LoRA training law in the Megatron engine: adapters trained as ``peft`` trains them.

One ``torchrun --nproc-per-node 4`` launch (``lora_megatron_worker.py``) runs two AdamW
steps (clipped to norm 0.5) of :class:`~areal_fn.runtime.engines.megatron.MegatronEngine`
built with ``lora=`` under ``megatron:d2t2``, ``d2p2``, ``t2p2`` and ``d2c2`` (qwen2),
``d2t2`` (qwen3), ``d2p2v2`` (a 4-layer qwen2, interleaved), ``d4e2`` (mixtral,
experts over 2 ranks, adapters on the attention projections) and ``d4e2``, ``d2p2e2``
and ``d4e4`` (qwen3_moe, adapters on q/k/v and on the routed experts: each local expert's
``linear_fc1`` / ``linear_fc2`` holding its part of PEFT's fused ``target_parameters``
pair), its ``linear_qkv`` / ``linear_fc1`` holding the fused adapters, from the same
base weights and adapters as ``peft.get_peft_model`` of the transformers model stepping
the whole batch (``lora_worker.reference``): loss, gradient norm and clipped adapter
gradients of each step, the adapters after both steps and the log-probs after them
agree within fp32 rounding; the base gets no gradient and does not move; the optimizer
holds the adapters alone; the adapters start as PEFT starts them (``lora_B`` zero).
Checkpoints: ``megatron:d2t2``'s adapters and AdamW state resume in an FSDP2 engine;
qwen3_moe's expert adapters saved under ``megatron:d4e2`` load bitwise under
``megatron:d2p2e2``, then ``fsdp:d4``, then ``megatron:d4e4`` (each saving for the next).
"""

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("megatron.core")

from areal_fn.runtime.launch import run_torchrun
from tests.distributed import lora_megatron_worker as worker
from tests.distributed import lora_worker

WORKER = Path(__file__).with_name("lora_megatron_worker.py")
REPO = Path(__file__).resolve().parents[2]

# fp32 tolerances; observed on CPU/gloo, torch 2.13, megatron-core 0.16, peft 0.21.2:
LOSS_ATOL = 1e-5  # <= 5.1e-7
NORM_RTOL = 2e-5  # <= 4.1e-6
GRAD_RTOL = 2e-5  # max abs diff / max |reference grad|: <= 8.1e-6 (d2p2v2)
ADAPTER_ATOL = 1e-5  # after two steps at lr 1e-2: <= 2.2e-6
LOGPROB_ATOL = 1e-5  # <= 1.7e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lora_megatron")
    result = run_torchrun(
        WORKER, ["--out", str(out)], nproc=worker.WORLD, timeout_s=900, cwd=REPO, check=False
    )
    path = out / "results.json"
    assert path.exists(), result.report()
    data: dict[str, Any] = json.loads(path.read_text())
    assert result.ok, result.report()
    return data


@pytest.mark.parametrize("case", [f"{c}/{s}" for c, s in worker.CASES])
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_megatron")
def test_megatron_adapter_training_equals_peft(results: dict[str, Any], case: str) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    assert rec["rank_errors"] == [None] * worker.WORLD, rec["rank_errors"]
    assert rec["fused_adapters"] > 0, "no fused linear_qkv adapter in the layout"
    experts = rec["expert_adapters"]
    assert experts == (2 * 2 * 2 * 4 if case.startswith("qwen3_moe/") else 0), experts
    assert rec["initial_b_zero"], "lora_B does not start at zero"
    assert rec["load_export_bitwise"], "load -> export of base and adapters is not bitwise"
    assert len(rec["steps"]) == lora_worker.STEPS
    for step in rec["steps"]:
        assert step["loss_abs_diff"] <= LOSS_ATOL, step
        assert step["grad_norm_rel_diff"] <= NORM_RTOL, step
        assert step["grad_max_abs_diff"] <= GRAD_RTOL * step["grad_max_abs"], step
    assert rec["adapter_max_abs_diff"] <= ADAPTER_ATOL, rec["adapter_max_abs_diff"]
    assert rec["logprob_max_abs_diff"] <= LOGPROB_ATOL, rec["logprob_max_abs_diff"]
    assert rec["base_with_grad"] == [] and rec["optimizer_is_adapters"]
    assert rec["base_unchanged"], "the base weights moved"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"lora": "fp16"},
            r"^LoRA in MegatronEngine runs in fp32; fp16_mixed with adapters is not built: "
            r"pass precision=None or PrecisionPolicy\.fp32\(\)$",
        ),
        (
            {"lora": "dropout"},
            r"^LoraConfig\.dropout=0\.1: MegatronEngine's adapters have no dropout; use "
            r"dropout=0$",
        ),
    ],
)
def test_what_megatron_lora_refuses_before_any_process_group(
    kwargs: dict[str, str], message: str
) -> None:
    from areal_fn.model.lora import LoraConfig, LoraError
    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.plans.memory import PrecisionPolicy
    from areal_fn.runtime.engines.megatron import MegatronEngine
    from areal_fn.strategy.allocation import ParallelDims

    spec = model_from_hf_config(lora_worker.CONFIGS["qwen2"])
    fp16 = kwargs["lora"] == "fp16"
    with pytest.raises(LoraError, match=message):
        MegatronEngine(
            spec,
            ParallelDims(tp=2),
            precision=PrecisionPolicy.fp16_mixed() if fp16 else None,
            lora=LoraConfig(rank=2, dropout=0.0 if fp16 else 0.1),
        )


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_megatron")
def test_megatron_adapter_checkpoint_resumes_in_the_fsdp2_engine(results: dict[str, Any]) -> None:
    """Adapters and AdamW state saved by ``megatron:d2t2`` (fused adapters) after one step
    load bitwise into an ``fsdp:d4`` FSDP2 engine, whose second step is PEFT's."""
    rec = results["cases"]["checkpoint"]
    assert rec["error"] is None, rec["error"]
    assert rec["adapters_bitwise"] and rec["steps_done"] == 2
    assert rec["second_loss_abs_diff"] <= LOSS_ATOL
    assert rec["adapter_max_abs_diff"] <= ADAPTER_ATOL


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_megatron")
def test_megatron_expert_adapter_checkpoint_loads_under_other_strategies(
    results: dict[str, Any],
) -> None:
    """qwen3_moe adapters on the routed experts (each local expert's ``lora_B`` holds
    columns ``e::E`` of PEFT's fused one) and their AdamW moments, saved by
    ``megatron:d4e2`` after one step, load bitwise into a fresh ``megatron:d2p2e2``
    engine; what it saves again into an FSDP2 ``fsdp:d4`` one; what that saves into a
    ``megatron:d4e4`` one. Each one's second step is PEFT's."""
    rec = results["cases"]["expert_checkpoint"]
    assert rec["error"] is None, rec["error"]
    assert rec["expert_tensors"] == 2 * 2 * 2, rec[
        "expert_tensors"
    ]  # 2 layers x 2 expert params x A/B
    for dst in worker.EXPERT_CHECKPOINT[2:]:
        got = rec[dst]
        assert got["adapters_bitwise"] and got["optimizer_bitwise"], (dst, got)
        assert got["steps_done"] == 2, (dst, got)
        assert got["second_loss_abs_diff"] <= LOSS_ATOL, (dst, got)
        assert got["adapter_max_abs_diff"] <= ADAPTER_ATOL, (dst, got)
