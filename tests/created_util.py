"""Tensors created while a block runs, seen through torch's dispatcher: which dtypes,
and the most bytes of the chosen ones alive at once (torch frees a tensor when its last
reference goes, so a weak reference's callback marks its end)."""

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Created(TorchDispatchMode):
    """Every plain tensor an operator returns (not a view) while the mode is active:
    ``seen`` holds ``(dtype, shape)`` of those ``chosen`` picks, ``peak`` the most bytes of
    them alive at once."""

    def __init__(self, chosen: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.chosen = chosen
        self.seen: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is not torch.Tensor or t._base is not None or not self.chosen(t):
                continue
            self.seen.append((t.dtype, tuple(t.shape)))
            key = id(t)
            self.live[key] = t.numel() * t.element_size()
            weakref.finalize(t, self.live.pop, key, None)
            self.peak = max(self.peak, sum(self.live.values()))
        return out


def _nbytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def fsdp2_step_state(
    spec: Any, ids: torch.Tensor, watch: Sequence[Created] = (), **engine_kwargs: Any
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes ``Fsdp2Engine`` holds for ``spec`` on ``fsdp:d1``
    (one gloo rank in this process) after one ``train_step(ids)`` run under the modes
    ``watch``; the optimizer's are AdamW's states and, under fp16, the loss scale's two
    tensors."""
    import contextlib

    import pytest
    import torch.distributed as dist

    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.strategy.allocation import ParallelDims

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        engine = Fsdp2Engine(spec, ParallelDims(dp=1), **engine_kwargs)
        with contextlib.ExitStack() as stack:
            for mode in watch:
                stack.enter_context(mode)
            engine.train_step(ids)
        params = list(engine.model.parameters())
        states = [t for s in engine.optimizer.state.values() for t in s.values()]
        if engine.scaler is not None:  # the scale and the growth tracker
            states += [engine.scaler._scale, engine.scaler._growth]
        return (
            _nbytes(params),
            _nbytes(p.grad for p in params if p.grad is not None),
            _nbytes(states),
        )
    finally:
        dist.destroy_process_group()
