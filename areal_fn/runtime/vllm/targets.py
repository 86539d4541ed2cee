"""Which layout a vLLM update targets, planned alike on both ends.

- ``sharded``: :func:`~areal_fn.layouts.vllm.vllm_layout`: each vLLM rank receives the
  canonical boxes its own parameters are made of (the families that layout describes);
- ``full``: each vLLM rank receives every canonical tensor whole and vLLM's own
  loaders cut its part (any family vLLM serves; the path of AReaL's and vLLM's
  ``nccl`` backend, kept for those families and as the benchmark's baseline). Its
  layout is ``inference_layout`` with one replica per vLLM rank, unpadded.
"""

from typing import Any

import attrs

from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.vllm import VLLM_FAMILIES, vllm_layout
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.transfer import plan_rank_transfers
from areal_fn.plans.transfer.bound import transfer_lower_bound
from areal_fn.strategy.allocation import ParallelDims

__all__ = ["Targets", "default_mode", "modes", "target_layout"]


def modes(model: ModelSpec) -> tuple[str, ...]:
    """The update modes ``model`` supports."""
    return ("sharded", "full") if model.model_type in VLLM_FAMILIES else ("full",)


def default_mode(model: ModelSpec) -> str:
    return modes(model)[0]


def target_layout(model: ModelSpec, mode: str, *, tp: int, pp: int) -> Layout:
    """The deployment's layout an update of ``mode`` writes."""
    if mode == "full":
        return inference_layout(model, ParallelDims(dp=tp * pp), vocab_multiple=1)
    return vllm_layout(model, ParallelDims(tp=tp, pp=pp))


@attrs.define(kw_only=True)
class Targets:
    """One end's plans of a connection (trainer ranks first, then the vLLM ranks)."""

    spec: ModelSpec
    src: Layout
    trainer_ranks: int
    tp: int
    pp: int
    #: this process's rank: a vLLM worker's rank in its deployment, else None (a trainer)
    local: int | None = None
    trainer_rank: int = 0
    _plans: dict[str, Any] = attrs.field(factory=dict)

    @property
    def rank(self) -> int:
        """This process's plan rank."""
        return self.trainer_rank if self.local is None else self.trainer_ranks + self.local

    @property
    def ranks(self) -> tuple[range, range]:
        n = self.trainer_ranks
        return range(n), range(n, n + self.tp * self.pp)

    def plan(self, mode: str) -> tuple[Any, dict[str, tuple[int, ...]]]:
        """This rank's rows of ``mode``'s plan, and (a vLLM rank) its tensors' shapes."""
        if mode not in self._plans:
            dst = target_layout(self.spec, mode, tp=self.tp, pp=self.pp)
            src_ranks, dst_ranks = self.ranks
            plan = plan_rank_transfers(
                self.src, dst, self.rank, src_ranks=src_ranks, dst_ranks=dst_ranks
            )
            shapes = (
                {}
                if self.local is None
                else {lt.name: lt.shape for lt in dst.local_tensors(self.local)}
            )
            self._plans[mode] = (plan, shapes)
        return self._plans[mode]  # type: ignore[no-any-return]

    def lower_bound(self, mode: str) -> int:
        """The least bytes any plan of ``mode`` moves, from the two layouts alone."""
        src_ranks, dst_ranks = self.ranks
        dst = target_layout(self.spec, mode, tp=self.tp, pp=self.pp)
        return transfer_lower_bound(self.src, dst, src_ranks=src_ranks, dst_ranks=dst_ranks)
