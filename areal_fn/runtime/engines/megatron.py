"""The Megatron-Core training engine: ``GPTModel`` chunks under a ``megatron_layout``.

Under ``torchrun``, after ``dist.init_process_group`` with as many ranks as the
layout (gloo on CPU: the redirections of :mod:`~areal_fn.runtime.megatron.cpu` are on
while the engine is open)::

    with MegatronEngine(spec, ParallelDims(tp=2, pp=2), optimizer=AdamWConfig(lr=1e-5)) as engine:
        engine.load_canonical(canonical)
        stats = engine.train_step(split_rows(global_ids, engine.dp_size, engine.dp_rank))

What runs, in order:

- the layout (pure): :func:`~areal_fn.layouts.megatron.megatron_layout` with the stage
  plan (``stages``, default Megatron's even split); the model's padded vocabulary and
  the pipeline split come from it (the plan is handed to Megatron as a
  ``pipeline_model_parallel_layout`` string, so both agree layer for layer);
- Megatron's ``parallel_state`` for the layout's TP/PP/VPP/CP/EP sizes (checked against
  the layout's mesh coordinates), the ``GPTModel`` chunks of
  :mod:`~areal_fn.runtime.megatron.build` (local spec, fp32), each wrapped in Megatron's
  ``DistributedDataParallel`` (contiguous fp32 gradient buffers, no
  distributed optimizer; bucket reductions overlapped with backward and activation
  recompute as ``run_options`` say); every parameter name and local shape is checked against
  the layout;
- a step: ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved 1F1B)
  over micro-batches of ``micro_batch_size`` rows with ``calculate_per_token_loss``:
  each micro-batch returns its summed token loss and token count, Megatron's
  ``finalize_model_grads`` all-reduces the gradient buffers over data parallelism,
  all-reduces the tied embedding's gradients between the first and last pipeline
  stage (the embedding group), and divides by the global token count; then the
  layout-weighted gradient norm (:func:`~areal_fn.runtime.engines.common.grad_norm`),
  clipping, and ``torch.optim.AdamW`` over the local parameters.

The steps live in :class:`~areal_fn.runtime.engines.megatron_steps.MegatronSteps`:
padded rows (``train_step``, ``forward_logprobs``) and packed variable-length
sequences (``train_step_packed``, ``forward_logprobs_packed``). Under context
parallelism (``cp > 1``) each CP rank runs chunks ``r`` and ``2 cp - 1 - r`` of every
row, through the core attention of :mod:`~areal_fn.runtime.megatron.context` (on a GPU
with Transformer Engine, TE's own), and the gradients and token counts are reduced
over ``dp x cp`` by Megatron.

The loss is computed over the real vocabulary only: the logits of the padding rows
of the output layer (read from the layout's padding pieces) are set to ``-inf``
before Megatron's vocab-parallel cross entropy, so the engine optimises the same
function as an unpadded Hugging Face model.

Under ``PrecisionPolicy.fp16_mixed()`` the chunks are fp16 (as Megatron's
``Float16Module`` makes them), AdamW steps fp32 master copies whose gradients are the
fp32 ``main_grad`` buffers, and the loss is scaled through ``config.grad_scale_func``
(divided by the global target count there, so ``finalize_model_grads`` runs without
its division); the scale's rules are in
:class:`~areal_fn.runtime.engines.common.DynamicLossScaler`.

Megatron's own optimizer (``get_megatron_optimizer``) is not used: on CPU it fails
(``FP32Optimizer`` allocates ``device='cuda'`` tensors, and
``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` gradients); see
``docs/engines.md``.
"""

import contextlib
import importlib.util
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.lora import adapter_layout, with_lora
from areal_fn.layouts.megatron import MegatronMeshes, megatron_layout, stages_for
from areal_fn.model.lora import LoraConfig, LoraError
from areal_fn.model.spec import ModelSpec
from areal_fn.pipeline.partition import StagePlan, megatron_layout_string
from areal_fn.plans.convert import Reader, to_hf, to_megatron_into
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.plans.optim import LossScale
from areal_fn.runtime.engines.common import (
    AdamWConfig,
    DynamicLossScaler,
    norm_weights,
    trained_adapters,
)
from areal_fn.runtime.engines.megatron_lora import (
    check_expert_lora,
    initial_adapters,
    inject_megatron_lora,
)
from areal_fn.runtime.engines.megatron_options import MegatronRunOptions, megatron_option_fields
from areal_fn.runtime.engines.megatron_steps import MegatronSteps
from areal_fn.runtime.engines.precision import megatron_loss_scale
from areal_fn.runtime.megatron import build as mb
from areal_fn.sharding.mesh import Axis
from areal_fn.strategy.allocation import Component, ParallelDims
from areal_fn.typecheck import beartype

__all__ = ["MegatronEngine"]

_ADAMW = AdamWConfig()
_RUN = MegatronRunOptions()


def _finalize_divided_before(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    """Megatron's ``finalize_model_grads`` without the division by the token count
    (fp16: :meth:`MegatronEngine._scale_loss` divided the loss before backward)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def _check_lora(lora: LoraConfig | None, loss_scale: LossScale | None) -> None:
    if lora is not None and loss_scale is not None:
        raise LoraError(
            "LoRA in MegatronEngine runs in fp32; fp16_mixed with adapters is not built: "
            "pass precision=None or PrecisionPolicy.fp32()"
        )
    if lora is not None and lora.dropout > 0:
        raise LoraError(
            f"LoraConfig.dropout={lora.dropout}: MegatronEngine's adapters have no dropout; "
            "use dropout=0"
        )


def _lora_layouts(
    base: Layout, model: ModelSpec, lora: LoraConfig | None
) -> tuple[Layout, Layout | None]:
    """The engine's layout (``with_lora`` of ``base`` under LoRA) and its adapters alone."""
    if lora is None:
        return base, None
    return with_lora(base, model, lora), adapter_layout(base, model, lora)


def _check_inputs(model_spec: ModelSpec, device_type: str) -> None:
    """What the engine refuses before anything is built."""
    if device_type not in ("cpu", "cuda"):
        raise LayoutError(
            f"device_type={device_type!r} is not 'cpu' or 'cuda'; the CPU runs Megatron "
            "with its CUDA-only calls redirected (gloo), 'cuda' the current CUDA device"
        )
    if model_spec.mtp_layers:
        raise LayoutError(
            f"the model has {model_spec.mtp_layers} multi-token-prediction layer(s) "
            "(mtp_layers): MegatronEngine computes its loss from the main model's logits "
            "and does not train MTP layers (Megatron-Core adds their loss inside "
            "GPTModel's own loss only); build the model without them "
            "(model_from_hf_config(config), the default) and read the checkpoint with "
            "drop_mtp=True. The megatron layout carries them for conversion, weight sync "
            "and checkpoints"
        )


class MegatronEngine(MegatronSteps):
    """Megatron-Core ``GPTModel`` chunks trained as ``megatron_layout`` lays them out.

    ``dims``: an allocation ``Component`` or ``ParallelDims`` (dp is what the world
    leaves, and must equal the world size over ``tp*pp*cp``). ``stages``: the pipeline
    split (default: Megatron's even split). ``micro_batch_size``: rows per pipeline
    micro-batch (the interleaved schedule needs a multiple of ``pp`` micro-batches).
    ``device_type``: ``"cpu"`` (Megatron's CUDA-only calls redirected, see
    :mod:`~areal_fn.runtime.megatron.cpu`) or ``"cuda"`` (no redirections; the chunks,
    gradient buffers and batches live on ``torch.cuda.current_device()``, so call
    ``torch.cuda.set_device`` first; the process group must carry CUDA tensors, e.g.
    NCCL). The ``"cuda"`` path has not been run on a GPU yet (``bench/gpu`` checks it).
    ``precision``: ``None`` or ``PrecisionPolicy.fp32()`` (fp32), or
    ``PrecisionPolicy.fp16_mixed()``: Megatron's fp16 (fp16 parameters, fp32 main
    gradients and master weights, a dynamic loss scale through ``config.grad_scale_func``;
    see :mod:`~areal_fn.runtime.engines.precision`).
    ``run_options``: activation recompute, gradient-reduce overlap and DDP bucket size
    (:class:`~areal_fn.runtime.engines.megatron_options.MegatronRunOptions`); they leave
    the step's results unchanged.
    ``lora``: train LoRA adapters with the base frozen
    (:mod:`~areal_fn.runtime.engines.megatron_lora`): the layout is ``with_lora`` of the
    Megatron layout (fused ``linear_qkv`` / ``linear_fc1`` adapters), the base gets no
    gradient buffer, no optimizer state and no reduction; fp32 only, no dropout.
    One engine per process at a time (Megatron's ``parallel_state`` is global); close it
    (or use it as a context manager) to tear the parallel state down.
    """

    @beartype
    def __init__(
        self,
        model_spec: ModelSpec,
        dims: Component | ParallelDims,
        *,
        stages: StagePlan | None = None,
        optimizer: AdamWConfig = _ADAMW,
        grad_clip: float | None = 1.0,
        precision: PrecisionPolicy | None = None,
        run_options: MegatronRunOptions = _RUN,
        micro_batch_size: int = 1,
        vocab_divisible_by: int = 128,
        device_type: str = "cpu",
        seed: int = 0,
        lora: LoraConfig | None = None,
    ) -> None:
        _check_inputs(model_spec, device_type)
        pdims = dims.dims if isinstance(dims, Component) else dims
        loss_scale = megatron_loss_scale(precision)  # pure: refused before any group exists
        _check_lora(lora, loss_scale)
        check_expert_lora(lora, pdims.etp)
        self.lora = lora
        self._option_fields = megatron_option_fields(
            run_options,
            mla=bool(model_spec.kv_lora_rank),
            te_installed=importlib.util.find_spec("transformer_engine") is not None,
            device_type=device_type,
        )
        self.run_options = run_options
        self.spec = model_spec
        self.dims = pdims
        self.vocab_divisible_by = vocab_divisible_by
        self.base_layout: Layout = megatron_layout(
            model_spec,
            pdims,
            stages=stages if stages is not None else stages_for(model_spec, pdims),
            vocab_divisible_by=vocab_divisible_by,
        )  # pure: fails before any process group is touched
        self.layout, self.adapter_layout = _lora_layouts(self.base_layout, model_spec, lora)
        plan = self.layout.stages
        assert plan is not None  # a Megatron layout carries its stage plan
        mb.rope_kwargs(attrs.asdict(model_spec))  # rope scaling GPTModel cannot apply fails here
        self.mesh = MegatronMeshes.of(pdims).dense
        self.grad_clip = grad_clip
        self.optimizer_config = optimizer
        self.steps_done = 0  # optimizer steps taken (the LR schedule's position)
        if micro_batch_size < 1:
            raise LayoutError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.micro_batch_size = micro_batch_size
        if not dist.is_initialized() or dist.get_world_size() != self.layout.world_size:
            have = dist.get_world_size() if dist.is_initialized() else "no"
            raise LayoutError(
                f"MegatronEngine for {pdims} needs an initialised default process group of "
                f"{self.layout.world_size} ranks, found {have}; launch that many processes "
                "and call dist.init_process_group first"
            )
        self.rank = dist.get_rank()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device_type == "cuda"
            else torch.device("cpu")
        )
        sizes = mb.MegatronSizes(
            tp=pdims.tp, pp=pdims.pp, cp=pdims.cp, ep=pdims.ep, etp=pdims.etp, vpp=pdims.vpp
        )
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(
                mb.megatron_session(sizes, seed=seed, cpu=device_type == "cpu")
            )
            self._build(plan, sizes, loss_scale)
            if lora is not None:  # PEFT's start: lora_A random, lora_B zero
                self.load_adapters(initial_adapters(model_spec, lora, seed=seed))
        except BaseException:
            self._stack.close()
            raise

    def _build(self, plan: StagePlan, sizes: mb.MegatronSizes, fp16: LossScale | None) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self._check_ranks()
        arch = mb.arch_of(self.spec)
        config = mb.transformer_config(
            arch,
            sizes,
            pipeline_model_parallel_layout=megatron_layout_string(plan)
            if self.dims.pp > 1
            else None,
            params_dtype=torch.float32 if fp16 is None else torch.float16,
            overrides=self._config_overrides(),
        )
        prefix = "model0." if self.dims.vpp > 1 else ""
        vocab = self.layout.tensor(prefix + "embedding.word_embeddings.weight").shape[0]
        chunks = [c.to(self.device) for c in mb.build_model_chunks(arch, config, vocab_size=vocab)]
        if self.lora is not None:  # before DDP: it makes buffers for what requires a gradient
            inject_megatron_lora(chunks, self.layout, self.rank, self.lora)
        if fp16 is not None:  # what Megatron's Float16Module does: every tensor in fp16,
            chunks = [c.half() for c in chunks]  # the norms' weights included
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=False,
            **self._option_fields[1],
        )
        self.chunks = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        config.no_sync_func = (
            [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        )
        if ddp_config.overlap_grad_reduce:  # as Megatron-LM: start each chunk's last reduce
            config.grad_sync_func = (  # in the schedule, after its last backward
                [c.start_grad_sync for c in self.chunks]
                if len(self.chunks) > 1
                else self.chunks[0].start_grad_sync
            )
        config.finalize_model_grads_func = (
            finalize_model_grads if fp16 is None else _finalize_divided_before
        )
        self.config = config
        self._te_cp = mb.uses_transformer_engine_cp(config)
        every = self._named_params()
        # what the optimizer steps: every parameter, or under LoRA the adapters alone
        self._params = {n: p for n, p in every.items() if p.requires_grad}
        # the layout's tensors: the parameters, and the routers' expert-bias buffers
        self._tensors: dict[str, Tensor] = {**every, **self._named_buffers()}
        self._check_params()
        self._weights = norm_weights(self.layout, self.rank)
        self._pad_cols = self._padding_columns(plan)
        self._masters = (  # fp16: the fp32 weights the optimizer steps (Megatron's main params)
            {}
            if fp16 is None
            else {n: torch.nn.Parameter(p.detach().float()) for n, p in self._params.items()}
        )
        # what local_state and load_canonical see: the fp32 weights, and the buffers
        self._state: dict[str, Tensor] = {**self._tensors, **self._masters}
        self.optimizer = self.optimizer_config.build(list(self._optimizer_params().values()))
        if fp16 is not None:
            self.scaler = DynamicLossScaler(fp16, device=self.device)
            config.grad_scale_func = self._scale_loss

    def _config_overrides(self) -> dict[str, Any]:
        overrides: dict[str, Any] = {"calculate_per_token_loss": True, **self._option_fields[0]}
        # (batched p2p is switched off on gloo by transformer_config itself)
        return overrides

    # -- checks against the layout -------------------------------------------------------
    def _check_ranks(self) -> None:
        from megatron.core import parallel_state as ps

        want = dict(zip(self.mesh.names, self.mesh.coords(self.rank), strict=True))
        got = {
            Axis.PP: ps.get_pipeline_model_parallel_rank(),
            Axis.DP: ps.get_data_parallel_rank(),
            Axis.CP: ps.get_context_parallel_rank(),
            Axis.TP: ps.get_tensor_model_parallel_rank(),
        }
        if got != want:
            raise LayoutError(
                f"rank {self.rank}: Megatron placed it at {got}, the layout's {self.mesh} at "
                f"{want}; Megatron's rank order must be 'tp-cp-ep-dp-pp'"
            )

    def _named_params(self) -> dict[str, torch.nn.Parameter]:
        vpp = self.dims.vpp > 1
        out = {}
        for v, chunk in enumerate(self.chunks):
            for name, p in chunk.module.named_parameters():
                out[f"model{v}.{name}" if vpp else name] = p
        return out

    def _named_buffers(self) -> dict[str, Tensor]:
        """Persistent buffers a checkpoint holds (``mlp.router.expert_bias``)."""
        vpp = self.dims.vpp > 1
        out = {}
        for v, chunk in enumerate(self.chunks):
            stored = set(chunk.module.state_dict())
            for name, b in chunk.module.named_buffers():
                if name in stored:
                    out[f"model{v}.{name}" if vpp else name] = b
        return out

    def _check_params(self) -> None:
        want = {lt.name: lt.shape for lt in self.layout.local_tensors(self.rank)}
        got = {n: tuple(p.shape) for n, p in self._tensors.items()}
        if got != want:
            diff = sorted(
                f"{n}: model {got.get(n)}, layout {want.get(n)}"
                for n in set(got) | set(want)
                if got.get(n) != want.get(n)
            )
            raise LayoutError(
                f"rank {self.rank}: the GPTModel chunks differ from the megatron layout in "
                f"{len(diff)} tensor(s): {diff[:6]}"
            )

    def _padding_columns(self, plan: StagePlan) -> Tensor | None:
        """Local logit columns of the output layer that are vocabulary padding (last stage).

        The output layer is ``output_layer.weight`` of the last chunk, or the embedding
        itself for a tied model on one stage; its padding pieces name the columns.
        """
        names = {t.name for t in self.layout.tensors}
        vstage = (plan.num_chunks - 1) // self.dims.pp
        prefix = f"model{vstage}." if self.dims.vpp > 1 else ""
        name = prefix + "output_layer.weight"
        if name not in names:
            name = "embedding.word_embeddings.weight"
        local = self.layout.tensor(name).local(self.rank)
        if local is None:
            return None
        pad = torch.ones(local.shape[0], dtype=torch.bool)
        for piece in local.pieces:
            if piece.canonical is not None:
                lo, hi = piece.local_box.ranges[0]
                pad[lo:hi] = False
        return pad.to(self.device)

    # -- geometry read from the layout -------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many shares a global batch has."""
        return self.mesh.axis_size(Axis.DP)

    @property
    def dp_rank(self) -> int:
        """This rank's share of a global batch."""
        return self.mesh.coords(self.rank)[self.mesh.axis_index(Axis.DP)]

    # -- state -------------------------------------------------------------------------
    def _optimizer_params(self) -> Mapping[str, Tensor]:
        return self._masters or self._params

    def _scale_loss(self, loss: Tensor) -> Tensor:
        """Megatron's ``grad_scale_func`` under fp16: the last stage's summed token loss
        times ``loss scale / global target count``, so that fp16 gradients have the
        mean loss's magnitude (Megatron's per-token loss divides after backward)."""
        return loss * (self.loss_scale / self._targets)

    def local_state(self) -> dict[str, Tensor]:
        """Layout tensor name -> this rank's live local parameter (shares storage).

        Under fp16 the fp32 master weights (the model's fp16 parameters are their copies,
        refreshed before every forward)."""
        return {name: p.detach() for name, p in self._state.items()}

    def local_grads(self) -> dict[str, Tensor | None]:
        """Layout tensor name -> this rank's gradient (Megatron's ``main_grad`` buffer view).

        After :meth:`train_step`: data-parallel reduced, divided by the global token
        count, clipped: what the optimizer used.
        """
        return {name: getattr(p, "main_grad", None) for name, p in self._tensors.items()}

    @beartype
    def load_canonical(self, canonical: "Mapping[str, Tensor] | Reader") -> None:
        """Write this rank's local tensors from canonical tensors (no communication).

        Each piece is copied straight into its parameter's storage, cast to the
        parameter's dtype (``to_megatron_into``); ``hf_views(path)`` reads an HF
        checkpoint so, without any intermediate tensor.
        """
        layout = self.layout
        if self.lora is not None and (
            not isinstance(canonical, Mapping)
            or not any(c.name in canonical for c in self._adapters.canonical)
        ):
            layout = self.base_layout  # the base alone; the adapters keep their values
        names = {lt.name for lt in layout.local_tensors(self.rank)}
        out = {n: t for n, t in self._state.items() if n in names}
        to_megatron_into(canonical, layout, self.rank, out=out, cast=True)

    def export_canonical(self) -> dict[str, Tensor]:
        """Every canonical tensor on every rank: local states all-gathered, then ``to_hf``.

        Collective. Gathers whole local states as objects (simple; the memory of the
        full model on every rank).
        """
        mine = {name: t.detach().cpu().clone() for name, t in self.local_state().items()}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, mine)
        return to_hf(dict(enumerate(states)), self.layout)

    # -- LoRA adapters -----------------------------------------------------------------
    @property
    def _adapters(self) -> Layout:
        return trained_adapters(self.adapter_layout)

    @beartype
    def load_adapters(self, adapters: Mapping[str, Tensor]) -> None:
        """Write this rank's pieces of the adapter tensors (PEFT's names, all of them)."""
        out = {lt.name: self._state[lt.name] for lt in self._adapters.local_tensors(self.rank)}
        to_megatron_into(adapters, self._adapters, self.rank, out=out, cast=True)

    def export_adapters(self) -> dict[str, Tensor]:
        """Every adapter tensor (PEFT's names) on every rank (collective; bitwise)."""
        mine = {n: t.detach().cpu().clone() for n, t in self.adapter_local_state().items()}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, mine)
        return to_hf(dict(enumerate(states)), self._adapters)

    def adapter_local_state(self) -> dict[str, Tensor]:
        """This rank's live adapter shards by ``adapter_layout`` name (checkpoint state)."""
        return {
            lt.name: self._state[lt.name].detach() for lt in self._adapters.local_tensors(self.rank)
        }

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Tear down Megatron's parallel state and the CPU redirections (idempotent)."""
        self._stack.close()

    def __enter__(self) -> "MegatronEngine":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
