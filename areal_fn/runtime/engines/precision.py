"""Which :class:`~areal_fn.plans.memory.PrecisionPolicy` each engine runs, and how.

The engines take the same policy record the memory estimator and the advisor read
(``precision=``; ``None`` keeps the engine's default) and run exactly two kinds:

- **fp32**: :meth:`PrecisionPolicy.fp32` (what the engines do without a policy);
- **fp16 with a dynamic loss scale** (``loss_scale``, see
  :class:`~areal_fn.plans.optim.LossScale`), in each engine's own form:
  ``Fsdp2Engine`` keeps fp32 sharded parameters (they are the optimizer's weights) and
  computes the forward under ``torch.autocast(dtype=float16)``
  (:meth:`PrecisionPolicy.fp32_params_fp16_compute`); ``MegatronEngine`` keeps fp16
  parameters, fp32 main gradients and fp32 master weights, Megatron's fp16 layout
  (:meth:`PrecisionPolicy.fp16_mixed`).

Any other policy is refused in one line that names the one to use. The checks are
pure; the loss scale itself runs in
:class:`~areal_fn.runtime.engines.common.DynamicLossScaler`.
"""

import attrs

from areal_fn.errors import LayoutError
from areal_fn.plans.memory import Optimizer, PrecisionPolicy
from areal_fn.plans.optim import LossScale

__all__ = ["fsdp2_loss_scale", "megatron_loss_scale"]

_FP32 = PrecisionPolicy.fp32()


def _common(engine: str, policy: PrecisionPolicy, fp16: PrecisionPolicy, name: str) -> str:
    """What both engines refuse alike ('' when nothing)."""
    if policy.optimizer is not Optimizer.ADAM or policy.state_dtype != "float32":
        return (
            f"{engine} steps torch AdamW with float32 states, not {policy.optimizer.value} "
            f"states in {policy.state_dtype}"
        )
    if policy.compute_dtype == "float16" and policy.loss_scale is None:
        return (
            f"{engine}: float16 compute without a loss scale lets small gradients underflow "
            f"to zero; add loss_scale=LossScale() (PrecisionPolicy.{name}())"
        )
    if policy not in (_FP32, fp16):
        return (
            f"{engine} runs float32 (PrecisionPolicy.fp32()) or float16 with a loss scale "
            f"(PrecisionPolicy.{name}(), any LossScale), not {policy}"
        )
    return ""


def _with_scale(policy: PrecisionPolicy) -> PrecisionPolicy:
    """``policy`` with the default loss scale (its settings are free; compare the rest)."""
    return attrs.evolve(policy, loss_scale=None if policy.loss_scale is None else LossScale())


def fsdp2_loss_scale(
    policy: PrecisionPolicy | None, *, run_param_dtype: str | None
) -> LossScale | None:
    """The loss scale ``Fsdp2Engine`` runs under ``policy`` (``None``: fp32 or the
    run options' mixed precision); refuses a policy it does not run."""
    if policy is None:
        return None
    problem = ""
    if policy.param_dtype != "float32" or policy.master_weights:
        problem = (
            f"Fsdp2Engine keeps its sharded parameters in float32 (they are the optimizer's "
            f"weights), not {policy.param_dtype} parameters"
            + (" with a master copy" if policy.master_weights else "")
            + "; use PrecisionPolicy.fp32_params_fp16_compute() for fp16 (fp16 parameters "
            "with fp32 masters are MegatronEngine's PrecisionPolicy.fp16_mixed())"
        )
    if not problem and policy.compute_dtype == "bfloat16":
        problem = (
            "Fsdp2Engine computes in bfloat16 through FSDP2's mixed precision: pass "
            "precision=None and run_options=Fsdp2RunOptions(param_dtype='bfloat16')"
        )
    fp16 = PrecisionPolicy.fp32_params_fp16_compute()
    name = "fp32_params_fp16_compute"
    problem = problem or _common("Fsdp2Engine", _with_scale(policy), fp16, name)
    if not problem and policy.loss_scale is not None and run_param_dtype == "bfloat16":
        problem = (
            "Fsdp2Engine: run_options.param_dtype='bfloat16' under an fp16 policy would "
            "compute in bfloat16; leave run_options.param_dtype None (or 'float16')"
        )
    if problem:
        raise LayoutError(problem)
    return policy.loss_scale


def megatron_loss_scale(policy: PrecisionPolicy | None) -> LossScale | None:
    """The loss scale ``MegatronEngine`` runs under ``policy`` (``None``: fp32); refuses
    a policy it does not run."""
    if policy is None:
        return None
    problem = ""
    if policy.param_dtype == "float32" and policy.compute_dtype == "float16":
        problem = (
            "MegatronEngine runs fp16 as Megatron does, with fp16 parameters and fp32 master "
            "weights (torch.autocast does not reach the backward of Megatron's CPU "
            "linear layers); use PrecisionPolicy.fp16_mixed()"
        )
    fp16 = PrecisionPolicy.fp16_mixed()
    problem = problem or _common("MegatronEngine", _with_scale(policy), fp16, "fp16_mixed")
    if problem:
        raise LayoutError(problem)
    return policy.loss_scale
