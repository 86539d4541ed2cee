"""The FSDP2 training engine: a transformers model under an ``fsdp2_layout``.

Under ``torchrun``, after ``dist.init_process_group`` with as many ranks as the
layout::

    engine = Fsdp2Engine(spec, parse_allocation("fsdp:d2t2").training,
                         optimizer=AdamWConfig(lr=1e-5), grad_clip=1.0)
    engine.load_canonical(canonical)
    stats = engine.train_step(split_rows(global_ids, engine.dp_size, engine.dp_rank))

What it does, in order: the layout comes from :func:`~areal_fn.layouts.fsdp2.fsdp2_layout`
(pure; bad input fails before any process group is touched); the model is built from
``model_spec.hf_config()`` with eager attention in float32 (the master weights;
``run_options.param_dtype`` sets the compute dtype); :func:`~areal_fn.runtime.engines.fsdp2_apply.apply_fsdp2`
applies TP, activation checkpointing and FSDP2 exactly as the layout says and checks
every parameter against it; torch AdamW steps the sharded parameters.

A training step: forward on this rank's rows, token losses summed and scaled by
``dp / global token count`` (FSDP2 averages gradients over the ``dp`` data-parallel
ranks, so the gradient is that of the global token mean), backward (FSDP2
reduce-scatters / all-reduces the gradients), the layout-weighted global gradient
norm, clipping, the optimizer step.
"""

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import Fsdp2Options, fsdp2_layout
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import Reader, iter_to_megatron
from areal_fn.runtime.engines import fsdp2_apply as fsdp2
from areal_fn.runtime.engines.common import (
    AdamWConfig,
    OptimizerSteps,
    TokenIds,
    TokenLogprobs,
    TokenMask,
    next_token_targets,
    norm_weights,
)
from areal_fn.runtime.engines.fsdp2_apply import DP_REPLICATE, DP_SHARD, TP, Fsdp2RunOptions
from areal_fn.strategy.allocation import Component, ParallelDims
from areal_fn.typecheck import beartype

__all__ = ["Fsdp2Engine", "build_hf_model"]

_OPTIONS = Fsdp2Options()
_RUN_OPTIONS = Fsdp2RunOptions()
_ADAMW = AdamWConfig()


@beartype
def build_hf_model(spec: ModelSpec, *, seed: int = 0) -> nn.Module:
    """The transformers causal LM of ``spec`` (eager attention, float32, seeded init)."""
    import transformers

    cfg = dict(spec.hf_config())
    model_type = str(cfg.pop("model_type"))
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Fsdp2Engine(OptimizerSteps):
    """A transformers model trained under FSDP2 (+TP, +HSDP) as ``fsdp2_layout`` lays it out.

    ``dims`` is an allocation ``Component`` (its ``dims``) or ``ParallelDims``;
    ``options`` change the layout (HSDP replicas, TP of the embeddings), ``run_options``
    only how it is applied (mixed precision, CPU offload, activation checkpointing).
    ``grad_clip=None`` disables clipping (the norm is still computed). Needs an
    initialised default process group of exactly the layout's world size.
    """

    @beartype
    def __init__(
        self,
        model_spec: ModelSpec,
        dims: Component | ParallelDims,
        *,
        options: Fsdp2Options = _OPTIONS,
        run_options: Fsdp2RunOptions = _RUN_OPTIONS,
        optimizer: AdamWConfig = _ADAMW,
        grad_clip: float | None = 1.0,
        device_type: str = "cpu",
        seed: int = 0,
    ) -> None:
        pdims = dims.dims if isinstance(dims, Component) else dims
        self.spec = model_spec
        self.layout: Layout = fsdp2_layout(model_spec, pdims, options=options)  # pure
        self.mesh = self.layout.meshes[0]
        self.grad_clip = grad_clip
        self.optimizer_config = optimizer
        self.steps_done = 0  # optimizer steps taken (the LR schedule's position)
        if not dist.is_initialized():
            raise LayoutError(
                "Fsdp2Engine needs an initialised default process group "
                f"({self.layout.world_size} ranks); call dist.init_process_group first"
            )
        self.rank = dist.get_rank()
        self.device_mesh = fsdp2.init_mesh(self.mesh, device_type=device_type)
        self.device = (
            torch.device(device_type, torch.cuda.current_device())
            if device_type == "cuda"
            else torch.device(device_type)
        )
        model = build_hf_model(model_spec, seed=seed).to(self.device)
        self.model = fsdp2.apply_fsdp2(model, self.layout, self.device_mesh, options=run_options)
        self._params: dict[str, nn.Parameter] = dict(self.model.named_parameters())
        # the layout's tensors: the parameters, and buffers such as a router's expert bias
        self._tensors: dict[str, Tensor] = fsdp2.layout_tensors(self.model)
        self._weights = norm_weights(self.layout, self.rank)
        self.optimizer = optimizer.build(list(self._params.values()))

    # -- geometry read from the layout -----------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (HSDP replicas x shards): how many shares a global batch has."""
        return self.mesh.size // self._tp

    @property
    def dp_rank(self) -> int:
        """This rank's share of a global batch (replica-major, like the mesh)."""
        coords = dict(zip(self.mesh.names, self.mesh.coords(self.rank), strict=True))
        shard = self.mesh.axis_size(DP_SHARD)
        return coords.get(DP_REPLICATE, 0) * shard + coords[DP_SHARD]

    @property
    def _tp(self) -> int:
        return self.mesh.axis_size(TP) if TP in self.mesh.names else 1

    # -- training ----------------------------------------------------------------------
    @beartype
    def train_step(
        self,
        input_ids: TokenIds,
        loss_mask: TokenMask | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's rows; returns global loss, grad norm, lr.

        Every rank of a TP group passes the same rows; data-parallel ranks pass their
        own share. Returns ``loss`` (global token mean before the step), ``grad_norm``
        (before clipping), ``clip_coef``, ``lr``, ``tokens`` (global target count).
        """
        targets, mask = next_token_targets(input_ids, loss_mask)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=input_ids.to(self.device)).logits[:, :-1]
        token_loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            targets.to(self.device).reshape(-1),
            reduction="none",
        ).reshape(targets.shape)
        local_sum = (token_loss * mask.to(self.device)).sum()
        stats = torch.stack(
            [local_sum.detach().double(), mask.sum().to(self.device, torch.float64)]
        )
        dist.all_reduce(stats)  # every TP rank of a data-parallel share adds the same
        total, count = (float(x) / self._tp for x in stats)
        if count == 0:
            raise LayoutError("the global batch has no target token (loss_mask is all False)")
        (local_sum * (self.dp_size / count)).backward()
        return self._clip_and_step(self.local_grads(), loss_sum=total, tokens=count)

    @beartype
    def forward_logprobs(self, input_ids: TokenIds) -> TokenLogprobs:
        """``log p(ids[:, t] | ids[:, :t])`` for ``t >= 1`` (eval mode, no grad, float32).

        Normalised over the whole vocabulary (TP logits are gathered). Collective: every
        rank calls it (each with its own rows).
        """
        targets, _ = next_token_targets(input_ids)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=input_ids.to(self.device)).logits[:, :-1]
                logp = torch.log_softmax(logits.float(), dim=-1)
                out = logp.gather(-1, targets.to(self.device).unsqueeze(-1)).squeeze(-1)
        finally:
            self.model.train(was_training)
        return out

    # -- state -------------------------------------------------------------------------
    def local_state(self) -> dict[str, Tensor]:
        """Layout tensor name -> this rank's live local shard (shares storage; do not resize)."""
        return {
            lt.name: _local(self._tensors[lt.name]).detach()
            for lt in self.layout.local_tensors(self.rank)
        }

    def local_grads(self) -> dict[str, Tensor | None]:
        """Layout tensor name -> this rank's local gradient (``None`` before any backward).

        After :meth:`train_step` these are the clipped gradients the optimizer used.
        """
        out: dict[str, Tensor | None] = {}
        for lt in self.layout.local_tensors(self.rank):
            if lt.name not in self._params:  # a buffer: not trained
                out[lt.name] = None
                continue
            g = self._params[lt.name].grad
            if isinstance(g, DTensor):
                p = self._params[lt.name]
                if tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
                    raise LayoutError(
                        f"{lt.name}: gradient placed {g.placements}, parameter "
                        f"{p.placements}; FSDP2 did not reduce it"  # type: ignore[attr-defined]
                    )
                g = g.to_local()
            out[lt.name] = g
        return out

    @beartype
    def load_canonical(self, canonical: "Mapping[str, Tensor] | Reader") -> None:
        """Write this rank's pieces of the canonical tensors into its shards (no communication).

        ``canonical`` is full canonical tensors by name, or a reader
        ``read(name, box)`` that loads only the slices this rank needs.
        """
        if isinstance(canonical, Mapping):
            fsdp2.load_canonical(self.model, self.layout, self.rank, canonical)
            return
        with torch.no_grad():
            for name, t in iter_to_megatron(canonical, self.layout, self.rank):
                _local(self._tensors[name]).copy_(t)

    def export_canonical(self) -> dict[str, Tensor]:
        """Every canonical tensor on every rank (collective; bitwise the shards' values)."""
        return fsdp2.export_canonical(self.model, self.layout)
