"""Megatron-Core parallel state from explicit sizes: :class:`MegatronSizes`, the process
groups, and :func:`megatron_session` (CPU redirections plus parallel state, undone on exit).

Runs under ``torchrun`` (one process per rank); on CPU with gloo when
:mod:`areal_fn.runtime.megatron.cpu` is enabled (:func:`megatron_session` enables it).
Re-exported by :mod:`areal_fn.runtime.megatron.build`.
"""

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from areal_fn.errors import LayoutError
from areal_fn.runtime.megatron import cpu as megatron_cpu
from areal_fn.typecheck import beartype

__all__ = [
    "ORDER",
    "MegatronSizes",
    "destroy_parallel_state",
    "init_distributed",
    "init_parallel_state",
    "megatron_session",
]

ORDER = "tp-cp-ep-dp-pp"


def _positive(_: Any, attribute: "attrs.Attribute[int]", value: int) -> None:
    if value < 1:
        raise LayoutError(f"{attribute.name}={value} must be >= 1")


def _optional_positive(_: Any, attribute: "attrs.Attribute[int | None]", value: int | None) -> None:
    if value is not None and value < 1:
        raise LayoutError(f"{attribute.name}={value} must be >= 1 or None")


@attrs.frozen(kw_only=True)
class MegatronSizes:
    """Megatron parallel sizes; data parallelism is what the world size leaves over.

    ``etp=None`` means expert tensor parallelism equals ``tp`` (Megatron's default);
    ``vpp=None`` means no virtual pipeline (``vpp=1`` is normalised to ``None``).
    """

    tp: int = attrs.field(default=1, validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)
    cp: int = attrs.field(default=1, validator=_positive)
    ep: int = attrs.field(default=1, validator=_positive)
    etp: int | None = attrs.field(default=None, validator=_optional_positive)
    vpp: int | None = attrs.field(
        default=None,
        converter=lambda v: None if v == 1 else v,
        validator=_optional_positive,
    )
    order: str = attrs.field(default=ORDER)

    def __attrs_post_init__(self) -> None:
        if self.vpp is not None and self.pp == 1:
            raise LayoutError(f"vpp={self.vpp} needs pp > 1 (pp={self.pp}); set pp or drop vpp")
        if sorted(self.order.split("-")) != sorted(ORDER.split("-")):
            raise LayoutError(f"order={self.order!r} must be a permutation of {ORDER!r}")

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; raises if the sizes do not fit."""
        dense = self.tp * self.pp * self.cp
        expert = self.expert_tp * self.ep * self.pp
        if world_size % dense:
            raise LayoutError(
                f"world_size={world_size} is not divisible by tp*pp*cp="
                f"{self.tp}*{self.pp}*{self.cp}={dense}; use a world size that is a multiple"
                f" of {dense}"
            )
        if world_size % expert:
            raise LayoutError(
                f"world_size={world_size} is not divisible by etp*ep*pp="
                f"{self.expert_tp}*{self.ep}*{self.pp}={expert}; use a world size that is a"
                f" multiple of {expert}"
            )
        return world_size // dense


# ------------------------------------------------------------ process groups


@beartype
def init_distributed(*, backend: str = "gloo", timeout_s: float | int = 300.0) -> None:
    """``init_process_group`` from torchrun's environment; a no-op when already done."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@beartype
def init_parallel_state(
    sizes: MegatronSizes, *, seed: int = 0, create_gloo_process_groups: bool = False
) -> None:
    """Initialise Megatron's ``parallel_state`` and its RNG streams for ``sizes``.

    Needs an initialised default process group (:func:`init_distributed`) and, on
    CPU, :mod:`megatron_cpu` enabled. Seeds the CPU generator with ``seed`` and
    Megatron's tensor/expert-parallel streams via ``model_parallel_cuda_manual_seed``.
    ``create_gloo_process_groups`` adds Megatron's extra gloo copies of the data
    parallel groups (only the distributed optimizer uses them; the default world is
    already gloo on CPU).
    """
    from megatron.core import parallel_state, tensor_parallel

    sizes.dp(dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        order=sizes.order,
        create_gloo_process_groups=create_gloo_process_groups,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@beartype
def destroy_parallel_state() -> None:
    """Tear down Megatron's ``parallel_state`` (groups, ranks, RNG tracker)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    parallel_state.destroy_model_parallel()
    mcore_random.initialize_rng_tracker(force_reset=True)


@contextlib.contextmanager
@beartype
def megatron_session(
    sizes: MegatronSizes,
    *,
    seed: int = 0,
    create_gloo_process_groups: bool = False,
    cpu: bool | None = None,
) -> Iterator[None]:
    """CPU redirections on (``cpu``, default: when no GPU is present), parallel state up
    for ``sizes``; both undone on exit, the process groups made for it destroyed.

    Initialises the default process group first if needed (left up on exit, so that
    one launch can run many sessions). Build and run models inside the block: on CPU
    they need the redirections, which are removed on exit.
    """
    use_cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    with megatron_cpu.cpu_megatron() if use_cpu else contextlib.nullcontext():
        init_distributed(backend="gloo" if use_cpu else "nccl")
        before = _groups()
        try:
            init_parallel_state(
                sizes, seed=seed, create_gloo_process_groups=create_gloo_process_groups
            )
            yield
        finally:
            destroy_parallel_state()
            _destroy_groups_since(before)


def _groups() -> list[dist.ProcessGroup]:
    """The process groups this process holds now (the default one included)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _destroy_groups_since(before: list[dist.ProcessGroup]) -> None:
    """Destroy the groups made since ``before``: Megatron's ``destroy_model_parallel``
    forgets its groups without destroying them, so each session would otherwise leave
    its groups' connections and threads behind (gloo: three threads per group)."""
    kept = {id(g) for g in before}
    for g in _groups():
        if id(g) not in kept:
            dist.destroy_process_group(g)
