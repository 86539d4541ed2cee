"""Megatron-Core's own optimizer on CUDA: ``get_megatron_optimizer``, distributed, bf16.

The engine steps ``torch.optim.AdamW`` (Megatron's optimizer does not run on CPU, see
``docs/engines.md``). On a GPU this check builds the same ``GPTModel``
(:mod:`areal_fn.runtime.megatron.build`, bf16 parameters, no CPU redirections),
loads the seeded canonical weights through the layout (``iter_to_megatron``), wraps it
in ``DistributedDataParallel(use_distributed_optimizer=True)`` and trains it with
``get_megatron_optimizer`` (``DistributedOptimizer``: fp32 main parameters, gradient
clipping, Adam) over ``get_forward_backward_func``; the loss must fall. CUDA only.
"""

import time
from typing import Any

import torch
from torch import Tensor

from areal_fn.layouts.megatron import megatron_layout, stages_for
from areal_fn.plans.convert import iter_to_megatron
from areal_fn.strategy.allocation import ParallelDims
from bench.gpu.compare import loss_fell
from bench.gpu.engines import BATCH, SEQ, TRAIN, Ctx, check_batch, check_spec, random_canonical
from bench.gpu.report import CheckResult

__all__ = ["megatron_dist_optimizer"]


def _model(ctx: Ctx) -> tuple[list[Any], Any, Any]:
    """(DDP chunks, TransformerConfig, optimizer): weights loaded before the optimizer
    copies them into its fp32 main parameters."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from areal_fn.runtime.megatron import build as mb

    spec, dims = check_spec(ctx), ParallelDims()
    layout = megatron_layout(spec, dims, stages=stages_for(spec, dims))
    arch = mb.arch_of(spec)
    config = mb.transformer_config(
        arch,
        mb.MegatronSizes(),
        params_dtype=torch.bfloat16,
        overrides={"calculate_per_token_loss": True},
    )
    vocab = layout.tensor("embedding.word_embeddings.weight").shape[0]
    chunks = [c.to(ctx.device) for c in mb.build_model_chunks(arch, config, vocab_size=vocab)]
    params = dict(chunks[0].named_parameters())
    with torch.no_grad():
        for name, t in iter_to_megatron(random_canonical(spec), layout, 0, dtype=torch.bfloat16):
            params[name].copy_(t)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = [DistributedDataParallel(config, ddp, c) for c in chunks]
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=TRAIN.lr,
        weight_decay=TRAIN.weight_decay,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, model, use_gloo_process_groups=False)
    return model, config, optimizer


def _step(model: list[Any], optimizer: Any, ids: Tensor, device: str) -> tuple[float, float]:
    """One step over ``BATCH`` micro-batches of one row: (token-mean loss, grad norm)."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ids = ids.to(device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), 1)[None, None]

    def forward(data: Any, chunk: Any) -> Any:
        row = next(data)
        logits = chunk(row, position_ids, mask)

        def loss(out: Tensor) -> Any:
            nll = tensor_parallel.vocab_parallel_cross_entropy(
                out[:, :-1].float().contiguous(), row[:, 1:]
            )
            total = nll.sum()
            count = torch.tensor(nll.numel(), dtype=torch.int, device=device)
            return total, count, {"sum": total.detach().clone(), "count": count}

        return logits, loss

    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    outs = get_forward_backward_func()(
        forward_step_func=forward,
        data_iterator=iter(ids.split(1)),
        model=model[0],
        num_microbatches=BATCH,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("Megatron's optimizer skipped the step (inf/nan gradients)")
    total = sum(float(o["sum"]) for o in outs)
    count = sum(int(o["count"]) for o in outs)
    return total / count, float(norm)


def megatron_dist_optimizer(ctx: Ctx) -> CheckResult:
    from areal_fn.runtime.megatron import build as mb

    if ctx.device != "cuda":
        return CheckResult(
            name="megatron_dist_optimizer",
            status="skipped",
            note="CUDA only: Megatron's optimizer does not run on CPU",
        )
    with mb.megatron_session(mb.MegatronSizes(), seed=0, cpu=False):
        model, _, optimizer = _model(ctx)
        ids = check_batch(check_spec(ctx))
        losses, norms, start = [], [], 0.0
        for i in range(ctx.steps):
            if i == 1:
                torch.cuda.synchronize()
                start = time.perf_counter()
            loss, norm = _step(model, optimizer, ids, ctx.device)
            losses.append(loss)
            norms.append(norm)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / max(ctx.steps - 1, 1)
    fell = loss_fell(losses)
    return CheckResult(
        name="megatron_dist_optimizer",
        status="ok" if fell else "fail",
        figures={
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "grad_norm_first": norms[0],
            "steps": len(losses),
            "s_per_step": per_step,
            "optimizer": type(optimizer).__name__,
        },
        note="" if fell else "the loss did not fall",
    )
