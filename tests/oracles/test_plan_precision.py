"""``areal-fn plan --precision``: the policy each training component is counted under,
printed and in the JSON; its bytes against what ``Fsdp2Engine`` holds on ``fsdp:d1``
after one step run as each policy runs there (fp32; bf16 through FSDP2's mixed precision;
fp16 under autocast with its loss scale): parameters, gradients, ``torch.optim.AdamW``'s
states and the loss scale's tensors; the advisor sizes each backend under a policy its
engine runs (the engines' own checks accept it)."""

import json

import pytest
import torch

from areal_fn.cli import main
from areal_fn.errors import LayoutError
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.embedded import resolve_config
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.advisor import suggest_strategy
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions
from areal_fn.runtime.engines.precision import fsdp2_loss_scale, megatron_loss_scale
from areal_fn.strategy.allocation import Backend
from tests.created_util import Created, fsdp2_step_state


def _out(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


#: How Fsdp2Engine runs each ``--precision`` (engine_policy's docstring says the same).
_RUNS: dict[str, dict[str, object]] = {
    "fp32": {},
    "bf16": {"run_options": Fsdp2RunOptions(param_dtype="bfloat16", reduce_dtype="float32")},
    "fp16": {"precision": PrecisionPolicy.fp32_params_fp16_compute()},
}


_IDS = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_fsdp_memory_is_the_state_the_engine_holds(
    capsys: pytest.CaptureFixture[str], precision: str
) -> None:
    doc = json.loads(_out(capsys, ["plan", "demo", "fsdp:d1", "--precision", precision, "--json"]))
    (row,) = doc["components"][0]["memory"]["per_rank"]
    spec = model_from_hf_config(DEMO_CONFIG)
    shapes = {t.shape for t in spec.tensors if len(t.shape) == 2}
    made = Created(lambda t: tuple(t.shape) in shapes)  # weight-shaped tensors
    state = fsdp2_step_state(spec, _IDS, [made], **_RUNS[precision])
    dtypes = {dtype for dtype, _ in made.seen}
    assert (row["params"], row["grads"], row["optimizer"]) == state
    # the weights were computed with in the compute dtype counted (bf16: FSDP2's
    # unsharded copies; fp16: autocast's casts), beside the fp32 parameters
    compute = doc["components"][0]["memory"]["precision"]["compute_dtype"]
    assert dtypes >= {getattr(torch, compute), torch.float32}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_lora_memory_is_the_state_the_engine_holds(
    capsys: pytest.CaptureFixture[str], precision: str
) -> None:
    """LoRA: the frozen base in fp32 (weights only), the adapters trained by AdamW."""
    from areal_fn.model.lora import LoraConfig, default_targets

    argv = ["plan", "demo", "fsdp:d1", "--precision", precision, "--lora-rank", "4", "--json"]
    doc = json.loads(_out(capsys, argv))
    (row,) = doc["components"][0]["memory"]["per_rank"]
    spec = model_from_hf_config(DEMO_CONFIG)
    lora = LoraConfig(rank=4, target_modules=default_targets(spec))
    state = fsdp2_step_state(spec, _IDS, lora=lora, **_RUNS[precision])
    assert (row["params"], row["grads"], row["optimizer"]) == state


def test_the_policy_is_printed_and_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "demo", "fsdp:d2+megatron:t2", "--precision", "fp16"]
    lines = [ln for ln in _out(capsys, argv).splitlines() if ln.startswith("precision")]
    assert lines == [
        "precision (--precision fp16): params float32, compute float16, grads (reduced) "
        "float32, no master copy, adam states float32: 16 B per parameter element; dynamic "
        "loss scale from 65536 (x2 after 2000 good steps, x0.5 on an overflow, the step "
        "skipped), 8 B per rank; FSDP2 keeps fp32 sharded parameters, gradients and Adam "
        "states (the optimizer's weights, no master copy) and computes in float16 under "
        "torch.autocast with the loss scale",
        "precision (--precision fp16): params float16, compute float16, grads (reduced) "
        "float32, float32 master weights, adam states float32: 18 B per parameter element; "
        "dynamic loss scale from 65536 (x2 after 2000 good steps, x0.5 on an overflow, the "
        "step skipped), 8 B per rank",
    ]
    doc = json.loads(_out(capsys, [*argv, "--json"]))
    fsdp, megatron = (c["memory"]["precision"] for c in doc["components"])
    default = torch.amp.GradScaler("cpu")
    scale = {
        "init_scale": default._init_scale,
        "growth_factor": default._growth_factor,
        "backoff_factor": default._backoff_factor,
        "growth_interval": default._growth_interval,
    }
    assert megatron == {
        "name": "fp16",
        "param_dtype": "float16",
        "compute_dtype": "float16",
        "grad_dtype": "float32",
        "master_dtype": "float32",
        "optimizer": "adam",
        "state_dtype": "float32",
        "loss_scale": scale,
        "loss_scale_bytes": 8,
        "bytes_per_param": 2 + 4 + 4 + 8,
    }
    assert fsdp == megatron | {
        "param_dtype": "float32",
        "master_dtype": None,
        "bytes_per_param": 16,
    }
    plain = json.loads(_out(capsys, ["plan", "demo", "megatron:t2", "--json"]))
    assert plain["components"][0]["memory"]["precision"]["name"] == "bf16"


def test_precision_without_a_training_component_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "demo", "vllm:t2", "--precision", "fp32"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--precision sets the policy of the training components (fsdp, megatron); vllm:d1t2 "
            "has none: drop --precision (inference weights keep the config's dtype)"
        )
    )


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_suggest_sizes_each_backend_under_a_policy_its_engine_runs(
    capsys: pytest.CaptureFixture[str], precision: str
) -> None:
    argv = ["plan", "Qwen2.5-7B", "--suggest", "8", "--device-memory", "80GB", "--top", "10"]
    doc = json.loads(_out(capsys, [*argv, "--precision", precision, "--json"]))
    a = doc["assumptions"]
    assert a["precision"] == precision and a["precision_policy"]["loss_scale_bytes"] == (
        8 if precision == "fp16" else 0
    )
    assert a["master_dtype"] == ("fp32" if precision == "fp16" else "none")
    named = PrecisionPolicy.fp16_mixed() if precision == "fp16" else PrecisionPolicy.fp32()
    model = model_from_hf_config(resolve_config("Qwen2.5-7B"))
    found = suggest_strategy(model, 8, 80 * 10**9, policy=named, top=10)
    assert {s.backend for s in found} == {Backend.FSDP, Backend.MEGATRON}
    for s in found:  # each engine's own check accepts the policy it was sized under
        if s.backend is Backend.FSDP:
            fsdp2_loss_scale(s.memory.policy, run_param_dtype=None)
        else:
            megatron_loss_scale(s.memory.policy)
    assert [s["allocation"] for s in doc["suggestions"]] == [s.allocation for s in found]
    assert [s["policy"] for s in doc["suggestions"]] == [str(s.memory.policy) for s in found]


def test_fsdp_counts_any_fp16_parameters_as_fsdp2_runs_them() -> None:
    """With or without a master copy, fp16 parameters are what Fsdp2Engine refuses; the
    policy counted for fsdp is one its check accepts."""
    import attrs

    from areal_fn.plans.precision import engine_policy

    fp16 = PrecisionPolicy.fp16_mixed()
    for policy in (fp16, attrs.evolve(fp16, master_weights=False)):
        with pytest.raises(LayoutError):
            fsdp2_loss_scale(policy, run_param_dtype=None)
        counted = engine_policy(policy, Backend.FSDP)
        assert fsdp2_loss_scale(counted, run_param_dtype=None) == policy.loss_scale
        assert engine_policy(policy, Backend.MEGATRON) == policy
