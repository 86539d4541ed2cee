"""Named precision policies, the one each training backend runs, and how a plan shows it.

``areal-fn plan --precision NAME`` picks one of :data:`PRECISIONS`; the memory
estimate and the advisor then count, for each training component, the policy its
engine runs (:func:`engine_policy`): the same record the engines take
(:mod:`~areal_fn.runtime.engines.precision`).
"""

from collections.abc import Callable
from typing import Any

import attrs

from areal_fn.errors import SpecError
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.strategy.allocation import Backend
from areal_fn.typecheck import beartype

__all__ = ["PRECISIONS", "engine_policy", "named_policy", "policy_json", "policy_line"]

#: The policies ``plan --precision`` names: Megatron's bf16 and fp16 layouts (bf16 or
#: fp16 parameters and compute, fp32 gradients, fp32 master weights and Adam states; fp16
#: with a dynamic loss scale) and plain fp32.
PRECISIONS: dict[str, Callable[[], PrecisionPolicy]] = {
    "bf16": PrecisionPolicy.bf16_mixed,
    "fp16": PrecisionPolicy.fp16_mixed,
    "fp32": PrecisionPolicy.fp32,
}


@beartype
def named_policy(name: str) -> PrecisionPolicy:
    """The policy :data:`PRECISIONS` names ``name``."""
    if name not in PRECISIONS:
        raise SpecError(
            f"precision {name!r} is not a named policy; use one of {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[name]()


@beartype
def engine_policy(policy: PrecisionPolicy, backend: Backend) -> PrecisionPolicy:
    """The policy an engine of ``backend`` runs for ``policy``.

    FSDP2 runs fp16 with fp32 sharded parameters (they are AdamW's weights) and fp16
    compute under autocast, and refuses fp16 parameters (with fp32 masters that is
    Megatron's layout): for FSDP a policy with fp16 parameters becomes fp32 parameters
    without a master copy, the rest (compute, gradients, optimizer states, loss scale)
    unchanged, which for ``PrecisionPolicy.fp16_mixed()`` is
    ``PrecisionPolicy.fp32_params_fp16_compute()``. Every other policy is counted as given.
    """
    if backend is Backend.FSDP and policy.param_dtype == "float16":
        return attrs.evolve(policy, param_dtype="float32", master_weights=False)
    return policy


@beartype
def policy_json(policy: PrecisionPolicy) -> dict[str, Any]:
    """The policy as JSON: its dtypes, the loss scale (null without one) and its bytes."""
    scale = policy.loss_scale
    return {
        "param_dtype": policy.param_dtype,
        "compute_dtype": policy.compute_dtype,
        "grad_dtype": policy.grad_dtype,
        "master_dtype": policy.master_dtype if policy.master_weights else None,
        "optimizer": policy.optimizer.value,
        "state_dtype": policy.state_dtype,
        "loss_scale": None if scale is None else attrs.asdict(scale),
        "loss_scale_bytes": policy.loss_scale_bytes,
        "bytes_per_param": policy.bytes_per_param,
    }


@beartype
def policy_line(policy: PrecisionPolicy) -> str:
    """One line: parameters, compute, gradients (which are reduced in that dtype), master
    weights, optimizer states, bytes per parameter element, and the loss scale."""
    scale = policy.loss_scale
    master = f"{policy.master_dtype} master weights" if policy.master_weights else "no master copy"
    head = (
        f"params {policy.param_dtype}, compute {policy.compute_dtype}, grads (reduced) "
        f"{policy.grad_dtype}, {master}, {policy.optimizer.value} states {policy.state_dtype}: "
        f"{policy.bytes_per_param} B per parameter element"
    )
    if scale is None:
        return head + "; no loss scale"
    return head + (
        f"; dynamic loss scale from {scale.init_scale:g} (x{scale.growth_factor:g} after "
        f"{scale.growth_interval} good steps, x{scale.backoff_factor:g} on an overflow, the "
        f"step skipped), {policy.loss_scale_bytes} B per rank"
    )
