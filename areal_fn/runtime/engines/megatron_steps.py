"""The Megatron engine's steps: batches through Megatron's pipeline schedule.

:class:`MegatronSteps` is the half of :class:`~areal_fn.runtime.engines.megatron.MegatronEngine`
that runs data: padded rows (:meth:`~MegatronSteps.train_step`,
:meth:`~MegatronSteps.forward_logprobs`) and packed variable-length sequences
(:meth:`~MegatronSteps.train_step_packed`, :meth:`~MegatronSteps.forward_logprobs_packed`,
rows built by :mod:`~areal_fn.runtime.engines.megatron_packing`). Every micro-batch is
a set of full rows with per-position targets, loss mask, optional weights and a
``[b or 1, 1, T, T]`` attention mask; under context parallelism each CP rank takes its
two of the ``2 * cp`` chunks of every row (:mod:`~areal_fn.runtime.megatron.context`),
reports the loss of its own tokens, and the log-probs are all-gathered over CP with
sequence order restored.
"""

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from areal_fn.errors import LayoutError
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.context import check_context_split
from areal_fn.runtime.engines.common import (
    OptimizerSteps,
    TokenIds,
    TokenLogprobs,
    TokenMask,
    next_token_targets,
)
from areal_fn.runtime.engines.megatron_packing import packed_micro_batches, unpack_logprobs
from areal_fn.runtime.engines.packed import PackedRow, TokenSequence
from areal_fn.runtime.megatron.context import gather_from_cp, split_for_cp
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.typecheck import beartype

__all__ = ["MegatronSteps"]


def _causal_mask(seq: int) -> Tensor:
    # Megatron's convention: True = masked out; [1, 1, sq, sk].
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


class _Micro(NamedTuple):
    """One micro-batch of full rows: ids, per-position targets, which count, their
    weights (``None``: 1) and the ``[b or 1, 1, T, T]`` attention mask."""

    ids: Tensor
    targets: Tensor
    mask: Tensor
    weights: Tensor | None
    attention: Tensor

    def local(self, device: torch.device) -> "_Micro":
        """This context-parallel rank's tokens, on ``device`` (the mask stays whole: the
        core attention takes the rows of its queries)."""
        w = None if self.weights is None else split_for_cp(self.weights.to(device))
        return _Micro(
            split_for_cp(self.ids.to(device)),
            split_for_cp(self.targets.to(device)),
            split_for_cp(self.mask.to(device)),
            w,
            self.attention.to(device),
        )


class MegatronSteps(OptimizerSteps):
    """Training and evaluation steps over the engine's chunks (set by the engine:
    ``spec``, ``chunks``, ``dims``, ``device``, ``micro_batch_size``, ``_pad_cols``, ``_te_cp``)."""

    spec: ModelSpec
    chunks: list[Any]
    dims: ParallelDims
    device: torch.device
    micro_batch_size: int
    _pad_cols: Tensor | None
    _te_cp: bool
    _masters: dict[str, torch.nn.Parameter]  # fp16: the fp32 weights the optimizer steps
    _targets: float = 1.0  # fp16: this step's global target count

    def local_grads(self) -> dict[str, Tensor | None]:
        raise NotImplementedError  # the engine's

    # -- the schedule --------------------------------------------------------------------
    def _nll(self, logits: Tensor, targets: Tensor) -> Tensor:
        from megatron.core import tensor_parallel

        assert self._pad_cols is not None  # only called on the last stage
        masked = logits.float().masked_fill(self._pad_cols, float("-inf"))
        return tensor_parallel.vocab_parallel_cross_entropy(masked.contiguous(), targets)

    def _rows(self, input_ids: Tensor, mask: Tensor) -> list[_Micro]:
        """Padded rows as micro-batches: per-position targets (the last column none)."""
        batch, seq = input_ids.shape
        mbs = self.micro_batch_size
        if batch % mbs:
            raise LayoutError(
                f"{batch} rows do not split into micro-batches of micro_batch_size={mbs}; "
                "pass a multiple of it"
            )
        check_context_split(seq, self.dims.cp)
        none = torch.zeros(batch, 1, dtype=input_ids.dtype)
        targets = torch.cat([input_ids[:, 1:], none], dim=1)
        mask = torch.cat([mask, torch.zeros(batch, 1, dtype=torch.bool)], dim=1)
        attention = _causal_mask(seq)
        return [
            _Micro(input_ids[i : i + mbs], targets[i : i + mbs], mask[i : i + mbs], None, attention)
            for i in range(0, batch, mbs)
        ]

    def _schedule(self, micro: list[_Micro], *, forward_only: bool) -> list[dict[str, Tensor]]:
        """Megatron's schedule over ``micro`` (full rows; each CP rank takes its chunks)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        with torch.no_grad():  # fp16: the parameters are copies of the fp32 masters
            for name, master in self._masters.items():
                self._params[name].copy_(master)
        local = [m.local(self.device) for m in micro]
        rows, seq = micro[0].ids.shape
        position_ids = split_for_cp(
            torch.arange(seq, device=self.device).unsqueeze(0).expand(rows, seq)
        )

        def step(data_iterator: Iterator[_Micro], model: Any) -> Any:
            ids, tgt, m, w, attention = next(data_iterator)
            output = model(ids, position_ids, attention)

            def loss_func(logits: Tensor) -> Any:
                nll = self._nll(logits, tgt)
                if forward_only:
                    return nll.sum() * 0.0, {"logprobs": (-nll).detach()}
                total = (nll * m if w is None else nll * m * w).sum()
                count = m.sum().to(torch.int)
                return total, count, {"sum": total.detach().clone(), "count": count.clone()}

            return output, loss_func

        data: Any = [iter(local) for _ in self.chunks] if len(self.chunks) > 1 else iter(local)
        return list(
            get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=data,
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(local),
                seq_length=seq,  # the full row: Megatron divides by cp itself
                micro_batch_size=rows,
                forward_only=forward_only,
            )
        )

    def _is_loss_reporter(self) -> bool:
        from megatron.core import parallel_state as ps

        # every context-parallel rank reports the loss of its own tokens
        return (
            ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0
        )

    # -- training ----------------------------------------------------------------------
    @beartype
    def train_step(
        self,
        input_ids: TokenIds,
        loss_mask: TokenMask | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this data-parallel rank's rows; same result keys as FSDP2's.

        Every TP, PP and CP rank of one data-parallel share passes the same rows; under
        context parallelism each takes its ``2`` of the ``2 * cp`` chunks of every row
        (the row length must be a multiple of ``2 * cp``).
        """
        _, mask = next_token_targets(input_ids, loss_mask)
        return self._train(self._rows(input_ids, mask))

    @beartype
    def train_step_packed(
        self, sequences: list[TokenSequence], *, max_tokens_per_micro_batch: int
    ) -> dict[str, float]:
        """One optimizer step on this data-parallel rank's variable-length sequences.

        The sequences are packed into rows of at most ``max_tokens_per_micro_batch``
        tokens (:mod:`~areal_fn.runtime.engines.megatron_packing`; under context
        parallelism rows are padded to a multiple of ``2 * cp``, which the budget must
        be too), one row per micro-batch, attention never crossing a sequence boundary.
        The loss is the weighted sum of the targets' cross entropies over the global
        count of targets; this equals running the sequences one by one.
        """
        micro, _ = self._packed(sequences, max_tokens_per_micro_batch)
        return self._train(micro)

    def _packed(
        self, sequences: list[TokenSequence], max_tokens: int
    ) -> tuple[list[_Micro], tuple[PackedRow, ...]]:
        if self.spec.linear_attention is not None:
            raise LayoutError(
                f"packed sequences for {self.spec.model_type}: Megatron-Core 0.16's "
                "GatedDeltaNet ignores the attention mask and refuses PackedSeqParams ('GDN "
                "does not support packed sequence for now'), so its recurrence would run from "
                "one sequence into the next; pass one sequence per row (train_step)"
            )
        if self._te_cp:
            raise LayoutError(
                f"packed sequences under cp={self.dims.cp} with Transformer Engine's attention: "
                "its causal kernel does not read the block-diagonal mask; pass padded rows "
                "(train_step) or run without Transformer Engine"
            )
        micro, rows = packed_micro_batches(
            sequences,
            max_tokens=max_tokens,
            multiple_of=2 * self.dims.cp if self.dims.cp > 1 else 1,
        )
        return [_Micro(*m) for m in micro], rows

    def _train(self, micro: list[_Micro]) -> dict[str, float]:
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:  # every TP, PP and CP rank of a share holds its rows
            held = torch.tensor(
                float(sum(int(m.mask.sum()) for m in micro)), dtype=torch.float64
            ).to(self.device)
            dist.all_reduce(held)
            self._targets = max(1.0, float(held) / (self.dims.tp * self.dims.pp * self.dims.cp))
        outputs = self._schedule(micro, forward_only=False)
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self._is_loss_reporter():
            for out in outputs:
                stats[0] += out["sum"].double()
                stats[1] += out["count"].double()
        dist.all_reduce(stats)
        total, count = float(stats[0]), float(stats[1])
        if count == 0:
            raise LayoutError("the global batch has no target token (loss_mask is all False)")
        stepped = self._masters or self._params  # fp16: the fp32 masters
        for name, p in self._params.items():  # the optimizer steps on Megatron's grad buffers
            stepped[name].grad = p.main_grad  # type: ignore[attr-defined]
        return self._clip_and_step(self.local_grads(), loss_sum=total, tokens=count)

    @beartype
    def forward_logprobs(self, input_ids: TokenIds) -> TokenLogprobs:
        """``log p(ids[:, t] | ids[:, :t])`` for ``t >= 1`` over the real vocabulary (eval, no grad).

        Computed on the last pipeline stage through the forward-only schedule (under
        context parallelism all-gathered over the CP group, sequence order restored)
        and broadcast to every stage, so every rank returns it.
        """
        _, mask = next_token_targets(input_ids)
        return self._logprobs(self._rows(input_ids, mask))[:, :-1]

    @beartype
    def forward_logprobs_packed(
        self, sequences: list[TokenSequence], *, max_tokens_per_micro_batch: int
    ) -> list[Tensor]:
        """Per sequence, ``log p(seq[t] | seq[:t])`` for ``t >= 1`` (as :meth:`forward_logprobs`
        of that sequence alone), computed on packed rows."""
        micro, rows = self._packed(sequences, max_tokens_per_micro_batch)
        logp = self._logprobs(micro)
        return unpack_logprobs(rows, list(logp.split(1)), [len(s) for s in sequences])

    def _logprobs(self, micro: list[_Micro]) -> Tensor:
        from megatron.core import parallel_state as ps

        modes = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()
        try:
            with torch.no_grad():
                outputs = self._schedule(micro, forward_only=True)
        finally:
            for c, mode in zip(self.chunks, modes, strict=True):
                c.train(mode)
        rows, seq = len(micro) * micro[0].ids.shape[0], micro[0].ids.shape[1]
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            logp = gather_from_cp(torch.cat([o["logprobs"] for o in outputs], dim=0).float())
        else:
            logp = torch.empty((rows, seq), dtype=torch.float32, device=self.device)
        if self.dims.pp > 1:
            dist.broadcast(
                logp,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        return logp
