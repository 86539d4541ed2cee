"""What every training engine offers: the interface the demo worker and tools program to.

:class:`~areal_fn.runtime.engines.fsdp2.Fsdp2Engine` and
:class:`~areal_fn.runtime.engines.megatron.MegatronEngine` both satisfy
:class:`Engine` structurally (no inheritance); mypy checks it wherever an engine is
passed as an ``Engine``.
"""

from collections.abc import Mapping
from typing import Any, Protocol

from torch import Tensor

from areal_fn.layouts.layout import Layout
from areal_fn.plans.convert import Reader
from areal_fn.runtime.engines.common import TokenIds, TokenLogprobs, TokenMask
from areal_fn.runtime.engines.packed import TokenSequence

__all__ = ["Engine"]


class Engine(Protocol):
    """A training engine executing a :class:`~areal_fn.layouts.layout.Layout` on this rank."""

    @property
    def layout(self) -> Layout:
        """The layout the engine executes (made by the pure core)."""
        ...

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken: the LR schedule's position."""
        ...

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many shares a global batch has."""
        ...

    @property
    def dp_rank(self) -> int:
        """This rank's share of a global batch."""
        ...

    def train_step(
        self, input_ids: TokenIds, loss_mask: TokenMask | None = None
    ) -> dict[str, float]:
        """One optimizer step: ``{"loss", "grad_norm", "clip_coef", "lr", "tokens"}``."""
        ...

    def train_step_packed(
        self, sequences: list[TokenSequence], *, max_tokens_per_micro_batch: int
    ) -> dict[str, float]:
        """One optimizer step on variable-length sequences packed into rows of at most
        ``max_tokens_per_micro_batch`` tokens; equal to running them one by one."""
        ...

    def forward_logprobs(self, input_ids: TokenIds) -> TokenLogprobs:
        """Next-token log-probabilities over the full vocabulary (collective)."""
        ...

    def forward_logprobs_packed(
        self, sequences: list[TokenSequence], *, max_tokens_per_micro_batch: int
    ) -> list[Tensor]:
        """Per sequence ``[n - 1]``: ``log p(ids[t] | ids[:t])`` for ``t >= 1``, computed packed."""
        ...

    def local_state(self) -> dict[str, Tensor]:
        """Layout tensor name -> this rank's live local tensor."""
        ...

    def local_grads(self) -> dict[str, Tensor | None]:
        """Layout tensor name -> this rank's local gradient."""
        ...

    def optimizer_local_state(self, *, create: bool = False) -> dict[str, dict[str, Tensor]]:
        """AdamW state per local tensor (live tensors)."""
        ...

    def scheduler_state(self) -> dict[str, Any]:
        """The LR schedule's checkpointable state (and fp16's loss scale)."""
        ...

    def load_scheduler_state(self, state: Mapping[str, Any]) -> None:
        """Resume the LR schedule from :meth:`scheduler_state`."""
        ...

    def load_canonical(self, canonical: "Mapping[str, Tensor] | Reader") -> None:
        """Write this rank's pieces of the canonical tensors (no communication)."""
        ...

    def export_canonical(self) -> dict[str, Tensor]:
        """Every canonical tensor on every rank (collective)."""
        ...
