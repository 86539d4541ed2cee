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

    ``Fsdp2Engine`` keeps its sharded parameters in fp32: they are AdamW's weights (no
    master copy), their gradients are fp32 (FSDP2 casts a reduced gradient to the
    sharded parameter's dtype) and so are AdamW's moments (torch AdamW keeps them in the
    parameter's dtype). It computes in 16 bits by other means: bf16 through FSDP2's
    mixed precision (``Fsdp2RunOptions(param_dtype="bfloat16", reduce_dtype="float32")``:
    the unsharded bf16 copies exist only in flight), fp16 under ``torch.autocast`` with
    a loss scale. So for FSDP every policy becomes fp32 parameters, gradients and
    optimizer states with no master copy, its compute dtype, optimizer and loss scale
    unchanged: ``PrecisionPolicy.bf16_mixed()`` is counted as
    ``PrecisionPolicy.fp32_params_bf16_compute()`` (16 B per parameter element, not 18),
    ``PrecisionPolicy.fp16_mixed()`` as ``PrecisionPolicy.fp32_params_fp16_compute()``.
    A megatron component is counted as given: Megatron-Core's mixed precision keeps
    16-bit parameters beside fp32 main gradients, master weights and Adam states.
    ``MegatronEngine`` runs the fp16 form (``PrecisionPolicy.fp16_mixed()``) and fp32;
    the bf16 form is what Megatron-Core's own ``DistributedOptimizer`` keeps on a GPU,
    which ``MegatronEngine`` does not build on the CPU.
    """
    if backend is Backend.FSDP:
        return attrs.evolve(
            policy,
            param_dtype="float32",
            grad_dtype="float32",
            master_weights=False,
            state_dtype="float32",
        )
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
