"""fp16's loss scale as data: ``LossScale``, the fp16 precision policies, their bytes,
which policy each engine runs, and the scale's law against ``torch.amp.GradScaler``.

The multi-rank behaviour (unscaling, the all-reduced skip, several steps of each engine
against torch's AMP) is tested under torchrun in
``tests/distributed/test_grad_equivalence.py`` (the ``+fp16`` cases).
"""

import attrs
import pytest
import torch

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.memory import Optimizer, PrecisionPolicy, estimate_memory
from areal_fn.plans.optim import LossScale
from areal_fn.runtime.engines.common import DynamicLossScaler
from areal_fn.runtime.engines.precision import fsdp2_loss_scale, megatron_loss_scale
from areal_fn.strategy.allocation import ParallelDims

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 50,
    "torch_dtype": "float32",
}


def test_defaults_are_grad_scalers() -> None:
    scaler = torch.amp.GradScaler("cpu")
    d = LossScale()
    assert d.init_scale == scaler.get_scale()
    assert d.growth_factor == scaler.get_growth_factor()
    assert d.backoff_factor == scaler.get_backoff_factor()
    assert d.growth_interval == scaler.get_growth_interval()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"init_scale": 0},
            r"^LossScale.init_scale=0.0 must be a finite number > 0, e.g. 65536.0$",
        ),
        ({"init_scale": float("inf")}, r"^LossScale.init_scale=inf must be a finite number > 0"),
        ({"growth_factor": 1}, r"^LossScale.growth_factor=1.0 must be a finite number > 1"),
        ({"backoff_factor": 1.0}, r"^LossScale.backoff_factor=1.0 must be a number in \(0, 1\)"),
        ({"backoff_factor": "half"}, r"^LossScale.backoff_factor='half' must be a number"),
        ({"growth_interval": 0}, r"^LossScale.growth_interval=0 must be an int >= 1, e.g. 2000$"),
        ({"growth_interval": True}, r"^LossScale.growth_interval=True must be an int >= 1"),
    ],
)
def test_loss_scale_refuses(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        LossScale(**kwargs)  # type: ignore[arg-type]


def test_scale_follows_grad_scaler() -> None:
    """Backoff on every overflow, growth after ``growth_interval`` good steps in a row:
    the scale and the growth tracker after each step equal ``torch.amp.GradScaler``'s."""
    config = LossScale(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    ours = DynamicLossScaler(config, device=torch.device("cpu"))
    torch_scaler = torch.amp.GradScaler(
        "cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3
    )
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    overflow = [False, False, False, True, False, True, True, False, False, False, False]
    for inf in overflow:
        torch_scaler.scale(torch.ones(()))  # creates the scale on first use
        p.grad = torch.tensor([1.0, float("inf") if inf else 2.0])
        torch_scaler.unscale_(opt)
        torch_scaler.step(opt)
        torch_scaler.update()
        ours.update(inf)
        want = torch_scaler.state_dict()
        assert ours.state_dict() == {
            "scale": want["scale"],
            "growth_tracker": want["_growth_tracker"],
        }
    assert ours.scale == 8.0 * 4 * 0.25 * 0.25 * 0.25 * 4  # grew twice, backed off thrice


def test_scaler_state_round_trips() -> None:
    a = DynamicLossScaler(LossScale(), device=torch.device("cpu"))
    a.update(True)
    a.update(False)
    b = DynamicLossScaler(LossScale(), device=torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 32768.0, "growth_tracker": 1}
    with pytest.raises(SpecError, match=r"needs 'scale' \(a float > 0\) and 'growth_tracker'"):
        b.load_state_dict({"scale": -1.0, "growth_tracker": 0})


def test_fp16_policies_and_their_bytes() -> None:
    mixed, fsdp = PrecisionPolicy.fp16_mixed(), PrecisionPolicy.fp32_params_fp16_compute()
    assert (mixed.param_dtype, mixed.grad_dtype, mixed.master_weights) == (
        "float16",
        "float32",
        True,
    )
    assert mixed.bytes_per_param == 18 and fsdp.bytes_per_param == 16
    assert mixed.loss_scale == fsdp.loss_scale == LossScale()
    assert mixed.loss_scale_bytes == 8 and PrecisionPolicy.bf16_mixed().loss_scale_bytes == 0
    assert str(mixed).endswith("(18 B/param), dynamic loss scale")
    namespace = {"PrecisionPolicy": PrecisionPolicy, "LossScale": LossScale, "Optimizer": Optimizer}
    assert eval(repr(mixed), namespace) == mixed
    with pytest.raises(TypeError):
        PrecisionPolicy(loss_scale=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["fsdp2", "megatron"])
def test_memory_counts_the_loss_scale_state(kind: str) -> None:
    """fp16 mixed costs what bf16 mixed costs per element (both 2-byte weights, fp32
    grads, master and Adam), plus the scale's 8 bytes per rank."""
    spec = model_from_hf_config(CONFIG)
    dims = ParallelDims(dp=2, tp=2)
    layout = fsdp2_layout(spec, dims) if kind == "fsdp2" else megatron_layout(spec, dims)
    bf16 = estimate_memory(layout, policy=PrecisionPolicy.bf16_mixed())
    fp16 = estimate_memory(layout, policy=PrecisionPolicy.fp16_mixed())
    for a, b in zip(bf16.rows, fp16.rows, strict=True):
        assert (b.params, b.grads, b.optimizer) == (a.params, a.grads, a.optimizer + 8)


def test_engines_run_their_own_fp16_form() -> None:
    fsdp, mixed = PrecisionPolicy.fp32_params_fp16_compute(), PrecisionPolicy.fp16_mixed()
    custom = LossScale(init_scale=4.0)
    assert fsdp2_loss_scale(attrs.evolve(fsdp, loss_scale=custom), run_param_dtype=None) == custom
    assert megatron_loss_scale(mixed) == LossScale()
    for policy in (None, PrecisionPolicy.fp32()):
        assert fsdp2_loss_scale(policy, run_param_dtype="bfloat16") is None
        assert megatron_loss_scale(policy) is None


@pytest.mark.parametrize(
    ("engine", "policy", "message"),
    [
        (
            "fsdp2",
            PrecisionPolicy.fp16_mixed(),
            r"^Fsdp2Engine keeps its sharded parameters in float32 \(they are the optimizer's "
            r"weights\), not float16 parameters with a master copy; use "
            r"PrecisionPolicy.fp32_params_fp16_compute\(\) for fp16",
        ),
        (
            "fsdp2",
            PrecisionPolicy.fp32_params_bf16_compute(),
            r"^Fsdp2Engine computes in bfloat16 through FSDP2's mixed precision: pass "
            r"precision=None and run_options=Fsdp2RunOptions\(param_dtype='bfloat16'\)$",
        ),
        (
            "fsdp2",
            attrs.evolve(PrecisionPolicy.fp32_params_fp16_compute(), loss_scale=None),
            r"^Fsdp2Engine: float16 compute without a loss scale lets small gradients underflow "
            r"to zero; add loss_scale=LossScale\(\) "
            r"\(PrecisionPolicy.fp32_params_fp16_compute\(\)\)$",
        ),
        (
            "megatron",
            PrecisionPolicy.fp32_params_fp16_compute(),
            r"^MegatronEngine runs fp16 as Megatron does, with fp16 parameters and fp32 master "
            r"weights .*; use PrecisionPolicy.fp16_mixed\(\)$",
        ),
        (
            "megatron",
            PrecisionPolicy.bf16_mixed(),
            r"^MegatronEngine runs float32 \(PrecisionPolicy.fp32\(\)\) or float16 with a loss "
            r"scale \(PrecisionPolicy.fp16_mixed\(\), any LossScale\), not params bfloat16",
        ),
        (
            "megatron",
            attrs.evolve(PrecisionPolicy.fp16_mixed(), optimizer="sgd"),
            r"^MegatronEngine steps torch AdamW with float32 states, not sgd states in float32$",
        ),
    ],
)
def test_engines_refuse_other_policies(engine: str, policy: PrecisionPolicy, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        if engine == "fsdp2":
            fsdp2_loss_scale(policy, run_param_dtype=None)
        else:
            megatron_loss_scale(policy)


def test_fsdp2_refuses_bf16_run_options_under_fp16() -> None:
    with pytest.raises(LayoutError, match=r"run_options.param_dtype='bfloat16' under an fp16"):
        fsdp2_loss_scale(PrecisionPolicy.fp32_params_fp16_compute(), run_param_dtype="bfloat16")


def test_engines_refuse_before_any_process_group() -> None:
    """The refusal comes from the constructors, before they look for a process group."""
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.runtime.engines.megatron import MegatronEngine

    spec = model_from_hf_config(CONFIG)
    with pytest.raises(LayoutError, match=r"^Fsdp2Engine keeps its sharded parameters"):
        Fsdp2Engine(spec, ParallelDims(dp=2), precision=PrecisionPolicy.fp16_mixed())
    with pytest.raises(LayoutError, match=r"^MegatronEngine runs fp16 as Megatron does"):
        MegatronEngine(
            spec, ParallelDims(tp=2), precision=PrecisionPolicy.fp32_params_fp16_compute()
        )
