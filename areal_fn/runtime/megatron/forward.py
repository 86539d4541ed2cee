"""Forward passes through Megatron-Core ``GPTModel`` s in eval mode: single-stage logits,
the tensor-parallel gather, and a forward-only pass through the pipeline schedule.

Under context parallelism each CP rank runs its chunks of the rows
(:func:`~areal_fn.runtime.megatron.context.split_for_cp`) and the logits are all-gathered
over CP in sequence order, so every CP rank returns the logits of the whole rows.

Re-exported by :mod:`areal_fn.runtime.megatron.build`.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from areal_fn.errors import LayoutError
from areal_fn.runtime.megatron.context import gather_from_cp, split_for_cp
from areal_fn.typecheck import beartype

__all__ = ["forward_logits", "gather_tp_logits", "pipeline_forward_logits"]


@contextlib.contextmanager
def _inference(models: Sequence[Any]) -> Iterator[None]:
    # eval mode (MoE refuses training-mode TP without sequence parallelism), no grad;
    # each model's previous mode is restored on exit.
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)


def _causal_mask(seq: int) -> torch.Tensor:
    # Megatron's convention: True = masked out; shape [batch or 1, 1, sq, sk].
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


@beartype
def forward_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[batch, seq, vocab(/tp)]`` of a single-stage model, in eval mode."""
    batch, seq = input_ids.shape
    position_ids = split_for_cp(torch.arange(seq).unsqueeze(0).expand(batch, seq))
    with _inference([model]):
        return gather_from_cp(model(split_for_cp(input_ids), position_ids, _causal_mask(seq)))


@beartype
def gather_tp_logits(logits: torch.Tensor) -> torch.Tensor:
    """All-gather vocab-sharded logits over the tensor-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


@beartype
def pipeline_forward_logits(
    chunks: Sequence[Any], input_ids: torch.Tensor, *, micro_batch_size: int | None = None
) -> torch.Tensor | None:
    """Forward-only pass (eval mode) through Megatron's pipeline schedule.

    ``input_ids`` (``[batch, seq]``, identical on every rank) is split into
    micro-batches of ``micro_batch_size`` rows (default: 1 per micro-batch, and at
    least ``pp`` micro-batches are needed under virtual pipeline). Returns the
    vocab-sharded logits ``[batch, seq, vocab/tp]`` on the last pipeline stage and
    ``None`` elsewhere.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = input_ids.shape
    mbs = micro_batch_size or 1
    if batch % mbs:
        raise LayoutError(
            f"batch={batch} is not divisible by micro_batch_size={mbs}; pick a divisor"
        )
    micro = list(split_for_cp(input_ids).split(mbs))
    position_ids = split_for_cp(torch.arange(seq).unsqueeze(0).expand(mbs, seq))
    mask = _causal_mask(seq)

    def step(data_iterator: Iterator[torch.Tensor], model: Any) -> tuple[Any, Any]:
        tokens = next(data_iterator)
        output = model(tokens, position_ids, mask)

        def collect(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return output_tensor.sum() * 0.0, {"logits": output_tensor.detach()}

        return output, collect

    data: Any = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    with _inference(chunks):
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=list(chunks) if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return gather_from_cp(torch.cat([o["logits"] for o in outputs], dim=0))
