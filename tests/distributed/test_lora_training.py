"""LoRA training law: the FSDP2 engine trains adapters as ``peft`` does on one process.

One ``torchrun --nproc-per-node 4`` launch (``lora_worker.py``) runs, for tiny qwen2 and
qwen3 models with adapters on every projection (``down_proj`` at another rank) and a
mixtral (MoE: the attention projections, ``fsdp:d2t2``), and a qwen3_moe with
adapters on q/k/v and its routed experts (PEFT's ``target_parameters`` on the fused
``gate_up_proj`` and ``down_proj``; ``fsdp:d4``, ``fsdp:d2t2`` and HSDP), two
AdamW steps (gradients clipped to norm 0.5) of
:class:`~areal_fn.runtime.engines.fsdp2.Fsdp2Engine` built with ``lora=`` under
``fsdp:d4``, HSDP (2 replicas x 2 shards), ``fsdp:d2t2``, Ulysses ``fsdp:d2c2`` and
``fsdp:t2c2``, from the same base weights and adapters, against ``peft.get_peft_model``
of the transformers model stepping the whole batch with ``torch.optim.AdamW`` over its
trainable parameters: loss, gradient norm and clipped adapter gradients of each step,
the adapters after both steps and the log-probs after them agree within fp32 rounding;
the base receives no gradient, is not in the optimizer and does not move.
"""

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from areal_fn.runtime.launch import run_torchrun
from tests.distributed import lora_worker as worker

WORKER = Path(__file__).with_name("lora_worker.py")
REPO = Path(__file__).resolve().parents[2]

# fp32 tolerances; observed on CPU/gloo, torch 2.13, peft 0.21.2:
LOSS_ATOL = 1e-5  # <= 6.0e-7 (loss ~ 3.9)
NORM_RTOL = 1e-5  # <= 1.2e-6
GRAD_RTOL = 1e-5  # max abs diff / max |reference grad|: <= 3.2e-6
ADAPTER_ATOL = 1e-5  # after two steps at lr 1e-2 (adapters move by 2e-2): <= 9.7e-7
LOGPROB_ATOL = 1e-5  # <= 1.9e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lora_training")
    result = run_torchrun(
        WORKER, ["--out", str(out)], nproc=worker.WORLD, timeout_s=600, cwd=REPO, check=False
    )
    path = out / "results.json"
    assert path.exists(), result.report()
    data: dict[str, Any] = json.loads(path.read_text())
    assert result.ok, result.report()
    return data


CASE_IDS = [worker.case_id(*c) for c in worker.CASES]


@pytest.mark.parametrize("case", CASE_IDS)
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_adapter_training_equals_peft(results: dict[str, Any], case: str) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    assert rec["rank_errors"] == [None] * worker.WORLD, rec["rank_errors"]
    assert rec["load_export_bitwise"], "load -> export of base and adapters is not bitwise"
    assert len(rec["steps"]) == worker.STEPS
    for step in rec["steps"]:
        assert step["loss_abs_diff"] <= LOSS_ATOL, step
        assert step["grad_norm_rel_diff"] <= NORM_RTOL, step
        assert step["grad_max_abs_diff"] <= GRAD_RTOL * step["grad_max_abs"], step
    assert rec["adapter_moved"] > 100 * ADAPTER_ATOL, "the reference steps moved nothing"
    assert rec["adapter_max_abs_diff"] <= ADAPTER_ATOL, rec["adapter_max_abs_diff"]
    assert rec["logprob_max_abs_diff"] <= LOGPROB_ATOL, rec["logprob_max_abs_diff"]


@pytest.mark.parametrize("case", CASE_IDS)
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_the_base_is_frozen(results: dict[str, Any], case: str) -> None:
    rec = results["cases"][case]
    assert rec["error"] is None, rec["error"]
    config = case.split("/")[0]
    assert rec["frozen"] > 0
    assert rec["adapters"] == {"mixtral": 16, "qwen3_moe": 20}.get(config, 28)
    assert rec["frozen_with_grad"] == [], "base parameters got gradients (so a reduction)"
    assert rec["frozen_requiring_grad"] == []
    assert rec["optimizer_params_are_adapters"] and rec["optimizer_state_is_adapters"]
    assert rec["base_unchanged"], "the base weights moved"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_adapters_under_tp_are_placed_beside_their_base(results: dict[str, Any]) -> None:
    """``fsdp:d2t2`` (mesh ``(dp_shard, tp)``): column-parallel q_proj's ``lora_B`` is split
    like its base, ``lora_A`` replicated over ``tp``; row-parallel o_proj's ``lora_A`` is split
    over ``tp`` like its base's columns, ``lora_B`` replicated; FSDP2 shards all on dim 0."""
    placed = results["cases"]["qwen2/fsdp:d2t2"]["placements"]
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert placed[f"{q}.lora_B.weight"] == placed[f"{q}.weight"]
    assert placed[f"{q}.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placed[f"{q}.lora_A.weight"] == "(Shard(dim=0), Replicate())"
    assert placed[f"{o}.weight"] == placed[f"{o}.lora_A.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placed[f"{o}.lora_B.weight"] == "(Shard(dim=0), Replicate())"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_expert_adapters_are_placed_like_their_fused_experts(results: dict[str, Any]) -> None:
    """HSDP (mesh ``(dp_replicate, dp_shard)``): PEFT's pair of a fused expert parameter is
    replicated over the replicas and sharded on dim 0 over ``dp_shard``, as its base is."""
    placed = results["cases"]["qwen3_moe/fsdp:d4+r2"]["placements"]
    for p in ("gate_up_proj", "down_proj"):
        base = f"model.layers.0.mlp.experts.{p}"
        assert placed[base] == "(Replicate(), Shard(dim=0))"
        assert placed[f"{base}_lora_A"] == placed[f"{base}_lora_B"] == placed[base]


def test_dropout_under_tp_is_refused_before_any_process_group() -> None:
    from areal_fn.model.lora import LoraConfig, LoraError
    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.strategy.parse import parse_allocation

    spec = model_from_hf_config(worker.CONFIGS["qwen2"])
    with pytest.raises(
        LoraError,
        match=r"^LoraConfig\.dropout=0\.1 with tp=2: the TP ranks of a layer would drop "
        r"different inputs; use dropout=0 under TP$",
    ):
        Fsdp2Engine(
            spec,
            parse_allocation("fsdp:d2t2").training,
            lora=LoraConfig(rank=2, dropout=0.1),
        )


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_adapter_checkpoint_resumes_under_another_strategy(results: dict[str, Any]) -> None:
    """Adapters and AdamW state saved after one step under ``fsdp:d2t2`` load bitwise
    into a fresh ``fsdp:d4`` engine, whose second step is the reference's second step."""
    rec = results["cases"]["checkpoint"]
    assert rec["error"] is None, rec["error"]
    assert rec["fresh_differs"], "the loading engine held the saved adapters already"
    assert rec["adapters_bitwise"] and rec["optimizer_bitwise"]
    assert rec["steps_done"] == 2
    assert rec["second_loss_abs_diff"] <= LOSS_ATOL
    assert rec["adapter_max_abs_diff"] <= ADAPTER_ATOL


def _spec_and_ids() -> tuple[Any, Any]:
    from areal_fn.model.spec import model_from_hf_config

    spec = model_from_hf_config(worker.CONFIGS[worker.CHECKPOINT[0]])
    return spec, worker.batch(spec)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_adapter_checkpoint_exports_to_peft_and_merged(
    results: dict[str, Any], tmp_path: Path
) -> None:
    """The saved adapters, exported to PEFT's format and merged into the base, give the
    training engine's log-probs in ``peft.PeftModel.from_pretrained`` and in transformers."""
    import peft
    import torch
    import transformers

    from areal_fn.model.hf_memory import hf_state_to_canonical
    from areal_fn.runtime.checkpoint.lora import export_merged, export_peft
    from areal_fn.runtime.engines.fsdp2 import build_hf_model
    from areal_fn.runtime.hf.io import write_hf_checkpoint

    rec = results["cases"]["checkpoint"]
    assert rec["error"] is None, rec["error"]
    spec, ids = _spec_and_ids()
    want = torch.tensor(rec["logprobs"])
    base_dir = write_hf_checkpoint(
        tmp_path / "base",
        hf_state_to_canonical(build_hf_model(spec).state_dict(), spec),
        model=spec,
    )
    adapter = export_peft(rec["path"], tmp_path / "adapter")
    merged = export_merged(rec["path"], base_dir, tmp_path / "merged")
    for model in (
        peft.PeftModel.from_pretrained(build_hf_model(spec), str(adapter)),
        transformers.AutoModelForCausalLM.from_pretrained(str(merged)),
    ):
        with torch.no_grad():
            got = worker.logprobs(model(input_ids=ids).logits, ids)
        assert float((got - want).abs().max()) <= LOGPROB_ATOL


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("lora_training")
def test_adapter_checkpoint_loads_into_megatron_fused_adapters(results: dict[str, Any]) -> None:
    """Offline, one process holding every rank: the FSDP2 engine's adapter checkpoint
    loads into Megatron ``t2p2``'s fused ``linear_qkv`` / ``linear_fc1`` adapters, which
    convert back to bitwise the adapters PEFT's export holds."""
    import torch

    from areal_fn.layouts.layout_for import layout_for
    from areal_fn.layouts.lora import adapter_layout
    from areal_fn.model.tensor_spec import torch_dtype
    from areal_fn.plans.convert import to_hf
    from areal_fn.runtime.checkpoint import CheckpointReader, RankState, load_checkpoint

    rec = results["cases"]["checkpoint"]
    assert rec["error"] is None, rec["error"]
    spec, _ = _spec_and_ids()
    layout = adapter_layout(layout_for(spec, "megatron:t2p2"), spec, worker.LORA)
    assert any(t.name.endswith("linear_qkv.lora_A.weight") for t in layout.tensors)
    states = {
        r: RankState(
            params={
                lt.name: torch.zeros(lt.shape, dtype=torch_dtype(lt.dtype))
                for lt in layout.local_tensors(r)
            }
        )
        for r in range(layout.world_size)
    }
    load_checkpoint(rec["path"], layout=layout, states=states, restore_rng_state=False)
    back = to_hf({r: s.params for r, s in states.items()}, layout)
    reader = CheckpointReader(rec["path"])
    assert set(back) == {t.name for t in reader.manifest.tensors}
    assert all(torch.equal(back[k], reader.read(k)) for k in back)
