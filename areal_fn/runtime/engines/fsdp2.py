"""The FSDP2 training engine: a transformers model under an ``fsdp2_layout``.

Under ``torchrun``, after ``dist.init_process_group`` with as many ranks as the
layout::

    engine = Fsdp2Engine(spec, parse_allocation("fsdp:d2t2").training,
                         optimizer=AdamWConfig(lr=1e-5), grad_clip=1.0)
    engine.load_canonical(canonical)
    stats = engine.train_step(split_rows(global_ids, engine.dp_size, engine.dp_rank))

What it does, in order: the layout comes from :func:`~areal_fn.layouts.fsdp2.fsdp2_layout`
(pure; bad input fails before any process group is touched); the model is built from
``model_spec.hf_config()`` in float32 (the master weights;
``run_options.param_dtype`` sets the compute dtype); :func:`~areal_fn.runtime.engines.fsdp2_apply.apply_fsdp2`
applies TP, activation checkpointing and FSDP2 exactly as the layout says and checks
every parameter against it; torch AdamW steps the sharded parameters.

Ulysses sequence parallelism (``c``, :mod:`~areal_fn.runtime.engines.ulysses`): the
``cp`` ranks of one data-parallel share (:func:`~areal_fn.layouts.fsdp2.fsdp2_data_mesh`)
pass the same rows; each computes targets on the full row, then runs the model on its
``T/cp`` consecutive tokens (their global ``position_ids``), attention all-to-all over
the share. ``dp_size`` counts data parallelism only. The model always runs our
attention function (eager math; with ``cp = 1`` it only builds the mask), so packed
sequences never attend across a boundary; a linear-attention layer (Qwen3-Next, Qwen3.5)
runs each sequence of a packed row alone (:mod:`~areal_fn.runtime.engines.linear_packed`).

A training step: forward on this rank's tokens, token losses summed and scaled by
``F / global token count``, where ``F = dp * cp`` is the FSDP group's size (FSDP2
averages gradients over it, so the gradient is that of the global token mean),
backward (FSDP2 reduce-scatters / all-reduces the gradients), the layout-weighted
global gradient norm, clipping, the optimizer step. :meth:`Fsdp2Engine.train_step_packed`
takes variable-length sequences instead (:mod:`~areal_fn.runtime.engines.packed`): each
packed row is a micro-batch of at most ``max_tokens_per_micro_batch`` tokens, run
forward and backward in turn (gradients accumulate), then one optimizer step. Ranks
that have fewer rows than another rank run empty rows (no target counts) so that
every rank takes part in the same number of FSDP2 collectives.
"""

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import Fsdp2Options, fsdp2_data_mesh, fsdp2_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.lora import adapter_layout, with_lora
from areal_fn.model.linear_attention import check_packing
from areal_fn.model.lora import LoraConfig, LoraError
from areal_fn.model.spec import ModelSpec
from areal_fn.plans.convert import Reader, to_megatron_into
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.runtime.engines import fsdp2_apply as fsdp2
from areal_fn.runtime.engines import linear_packed, ulysses
from areal_fn.runtime.engines.common import (
    AdamWConfig,
    DynamicLossScaler,
    OptimizerSteps,
    TokenIds,
    TokenLogprobs,
    TokenMask,
    next_token_targets,
    norm_weights,
    trained_adapters,
)
from areal_fn.runtime.engines.fp8_training import check_float8
from areal_fn.runtime.engines.fsdp2_apply import DP_REPLICATE, DP_SHARD, TP, Fsdp2RunOptions
from areal_fn.runtime.engines.lora import adapter_parameters, inject_lora
from areal_fn.runtime.engines.packed import PackedRow, TokenSequence, full_row_targets, pack_rows
from areal_fn.runtime.engines.precision import fsdp2_loss_scale
from areal_fn.sharding.mesh import Axis
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
    ``grad_clip=None`` disables clipping (the norm is still computed). ``precision``:
    ``None`` or ``PrecisionPolicy.fp32()`` (fp32, or ``run_options``' mixed precision),
    or ``PrecisionPolicy.fp32_params_fp16_compute()``: the forward under
    ``torch.autocast(dtype=float16)`` with a dynamic loss scale
    (:mod:`~areal_fn.runtime.engines.precision`). Needs an initialised default process
    group of exactly the layout's world size.

    ``lora``: train LoRA adapters with the base frozen (:mod:`~areal_fn.runtime.engines.lora`).
    The layout is then ``with_lora`` of the FSDP2 layout (the adapters placed beside their
    base layers); the base parameters get no gradient, no optimizer state and no gradient
    reduction; the optimizer steps the adapters alone. ``base_layout`` and
    ``adapter_layout`` are the two parts. Dropout is refused under TP.
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
        precision: PrecisionPolicy | None = None,
        device_type: str = "cpu",
        seed: int = 0,
        lora: LoraConfig | None = None,
    ) -> None:
        pdims = dims.dims if isinstance(dims, Component) else dims
        if lora is not None and lora.dropout > 0 and pdims.tp > 1:
            raise LoraError(
                f"LoraConfig.dropout={lora.dropout} with tp={pdims.tp}: the TP ranks of a layer "
                "would drop different inputs; use dropout=0 under TP"
            )
        loss_scale = fsdp2_loss_scale(precision, run_param_dtype=run_options.param_dtype)
        check_float8(run_options.float8_recipe, tp=pdims.tp, precision=precision, lora=lora)
        self.spec = model_spec
        self.dims = pdims
        self.options = options
        self.lora = lora
        self.base_layout: Layout = fsdp2_layout(model_spec, pdims, options=options)  # pure
        self.layout: Layout = (
            self.base_layout if lora is None else with_lora(self.base_layout, model_spec, lora)
        )
        self.adapter_layout: Layout | None = (
            None if lora is None else adapter_layout(self.base_layout, model_spec, lora)
        )
        self.mesh = self.layout.meshes[0]
        self.sp = pdims.cp
        self.data_mesh = fsdp2_data_mesh(self.mesh, pdims.cp)  # pure
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
        self.sp_group = fsdp2.init_groups(self.data_mesh.groups(Axis.CP), self.rank)
        model = build_hf_model(model_spec, seed=seed).to(self.device)
        if lora is not None:
            inject_lora(model, model_spec, lora, seed=seed)
        if not model_spec.family.indexer:  # DSA: transformers' eager mask carries the top-k
            ulysses.install(model, self.sp_group)
        linear_packed.install(model, model_spec)  # packed rows: each sequence alone
        self.model = fsdp2.apply_fsdp2(model, self.layout, self.device_mesh, options=run_options)
        # what the optimizer steps: every parameter, or under LoRA the adapters alone
        self._params: dict[str, nn.Parameter] = (
            dict(self.model.named_parameters()) if lora is None else adapter_parameters(self.model)
        )
        # the layout's tensors: the parameters, and buffers such as a router's expert bias
        self._tensors: dict[str, Tensor] = fsdp2.layout_tensors(self.model)
        self._weights = norm_weights(self.layout, self.rank)
        self.optimizer = optimizer.build(list(self._params.values()))
        if loss_scale is not None:
            self.scaler = DynamicLossScaler(loss_scale, device=self.device)

    # -- geometry read from the layout -----------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel shares of a global batch (HSDP replicas x data shards; not ``cp``)."""
        return self.mesh.size // (self._tp * self.sp)

    @property
    def dp_rank(self) -> int:
        """This rank's share of a global batch (replica-major, like the mesh)."""
        coords = self._coords
        shard = self.data_mesh.axis_size(DP_SHARD)
        return coords.get(DP_REPLICATE, 0) * shard + coords[DP_SHARD]

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence-parallel group: it computes tokens
        ``[sp_rank * T/cp, (sp_rank + 1) * T/cp)`` of every row."""
        return self._coords[Axis.CP]

    @property
    def _coords(self) -> dict[str, int]:
        m = self.data_mesh
        return dict(zip(m.names, m.coords(self.rank), strict=True))

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

        Every rank of a TP or sequence-parallel group passes the same rows;
        data-parallel shares pass their own. The row length must be a multiple of ``cp``.
        Returns ``loss`` (global token mean before the step), ``grad_norm`` (before
        clipping), ``clip_coef``, ``lr``, ``tokens`` (global target count).
        """
        next_token_targets(input_ids, loss_mask)  # checks shapes
        self._check_length(input_ids.shape[1])
        return self._train_rows([full_row_targets(input_ids, loss_mask)])

    @beartype
    def train_step_packed(
        self, sequences: list[TokenSequence], *, max_tokens_per_micro_batch: int
    ) -> dict[str, float]:
        """One optimizer step on this share's variable-length sequences, packed.

        The loss is the global mean over counted targets of ``weights * cross entropy``
        (every sequence's own next tokens); equal to running the sequences one by one.
        Rows hold at most ``max_tokens_per_micro_batch`` tokens (a multiple of ``cp``)
        and are padded to a multiple of ``cp``; a longer sequence is refused.
        """
        check_packing(self.spec)
        rows = pack_rows(sequences, max_tokens=max_tokens_per_micro_batch, multiple_of=self.sp)
        return self._train_rows(list(rows))

    def _check_length(self, seq: int) -> None:
        if seq % self.sp:
            raise LayoutError(
                f"rows of {seq} tokens do not split over cp={self.sp} sequence-parallel ranks; "
                f"pad rows to a multiple of {self.sp} (loss_mask False) or use train_step_packed"
            )

    def _even_rows(self, rows: list[PackedRow]) -> list[PackedRow]:
        """``rows`` plus empty rows up to the most rows any rank holds."""
        n = torch.tensor(len(rows), dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        empty = full_row_targets(torch.zeros(1, self.sp, dtype=torch.long), None)
        empty = PackedRow(
            input_ids=empty.input_ids,
            position_ids=empty.position_ids,
            targets=empty.targets,
            counted=torch.zeros_like(empty.counted),
            weights=torch.zeros_like(empty.weights),
            sequences=(),
            offsets=(),
        )
        return rows + [empty] * (int(n) - len(rows))

    def _slice(self, row: PackedRow, field: Tensor) -> Tensor:
        width = row.input_ids.shape[1] // self.sp
        return field[:, self.sp_rank * width : (self.sp_rank + 1) * width].to(self.device)

    def _logits(self, row: PackedRow) -> Tensor:
        with torch.autocast(self.device.type, torch.float16, enabled=self.scaler is not None):
            logits: Tensor = self.model(
                input_ids=self._slice(row, row.input_ids),
                position_ids=self._slice(row, row.position_ids),
                use_cache=False,
            ).logits
        return logits.float()

    def _train_rows(self, rows: list[PackedRow]) -> dict[str, float]:
        rows = self._even_rows(rows)
        held = float(sum(int(r.counted.sum()) for r in rows))
        count_t = torch.tensor(held, dtype=torch.float64, device=self.device)
        dist.all_reduce(count_t)  # every TP and SP rank of a share adds the same
        count = float(count_t) / (self._tp * self.sp)
        if count == 0:
            raise LayoutError("the global batch has no target token (loss_mask is all False)")
        # FSDP2 averages over dp * cp ranks; fp16 multiplies by the loss scale too
        scale = (self.dp_size * self.sp) / count * self.loss_scale
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for row in rows:
            logits = self._logits(row)
            token_loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                self._slice(row, row.targets).reshape(-1),
                reduction="none",
            ).reshape(logits.shape[:2])
            row_sum = (token_loss * self._slice(row, row.weights)).sum()
            (row_sum * scale).backward()
            local += row_sum.detach().double()
        dist.all_reduce(local)  # every TP rank of a data-parallel share adds the same
        total = float(local) / self._tp
        return self._clip_and_step(self.local_grads(), loss_sum=total, tokens=count)

    def _row_logprobs(self, row: PackedRow) -> Tensor:
        """``log p(target)`` at every token of ``row`` ``[b, L]`` (gathered over ``cp``)."""
        logp = torch.log_softmax(self._logits(row), dim=-1)
        mine = logp.gather(-1, self._slice(row, row.targets).unsqueeze(-1)).squeeze(-1)
        if self.sp_group is None:
            return mine
        parts = [torch.empty_like(mine) for _ in range(self.sp)]
        dist.all_gather(parts, mine.contiguous(), group=self.sp_group)
        return torch.cat(parts, dim=1)

    def _eval(self, rows: list[PackedRow]) -> list[Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return [self._row_logprobs(r) for r in self._even_rows(rows)][: len(rows)]
        finally:
            self.model.train(was_training)

    @beartype
    def forward_logprobs(self, input_ids: TokenIds) -> TokenLogprobs:
        """``log p(ids[:, t] | ids[:, :t])`` for ``t >= 1`` (eval mode, no grad, float32).

        Normalised over the whole vocabulary (TP logits are gathered), gathered over
        the sequence-parallel ranks. Collective: every rank calls it (each data-parallel
        share with its own rows).
        """
        next_token_targets(input_ids)
        self._check_length(input_ids.shape[1])
        return self._eval([full_row_targets(input_ids, None)])[0][:, :-1]

    @beartype
    def forward_logprobs_packed(
        self, sequences: list[TokenSequence], *, max_tokens_per_micro_batch: int
    ) -> list[Tensor]:
        """Per sequence ``[n - 1]``: ``log p(ids[t] | ids[:t])``, ``t >= 1``, computed packed."""
        check_packing(self.spec)
        rows = pack_rows(sequences, max_tokens=max_tokens_per_micro_batch, multiple_of=self.sp)
        out: dict[int, Tensor] = {}
        for row, logp in zip(rows, self._eval(list(rows)), strict=True):
            for i, start in zip(row.sequences, row.offsets, strict=True):
                out[i] = logp[0, start : start + len(sequences[i]) - 1]
        return [out[i] for i in range(len(sequences))]

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
            if lt.name not in self._params:  # a buffer, or a frozen base under LoRA
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
        ``read(name, box)`` that loads only the slices this rank needs (``hf_views(path)``
        of an HF checkpoint). Each piece is copied straight into its shard's storage,
        cast to the parameter's dtype (``to_megatron_into``), without a tensor of its own.

        Under LoRA a reader, or a mapping that holds no adapter tensor, loads the base
        alone (the adapters keep their values); a mapping with adapters must hold them all.
        """
        layout = self.layout
        if self.lora is not None and (
            not isinstance(canonical, Mapping)
            or not any(c.name in canonical for c in self._adapters.canonical)
        ):
            layout = self.base_layout
        if isinstance(canonical, Mapping):
            fsdp2.load_canonical(self.model, layout, self.rank, canonical)
            return
        names = {lt.name for lt in layout.local_tensors(self.rank)}
        out = {name: _local(t) for name, t in self._tensors.items() if name in names}
        to_megatron_into(canonical, layout, self.rank, out=out, cast=True)

    def export_canonical(self) -> dict[str, Tensor]:
        """Every canonical tensor on every rank (collective; bitwise the shards' values)."""
        return fsdp2.export_canonical(self.model, self.layout)

    # -- LoRA adapters -----------------------------------------------------------------
    @property
    def _adapters(self) -> Layout:
        return trained_adapters(self.adapter_layout)

    @beartype
    def load_adapters(self, adapters: Mapping[str, Tensor]) -> None:
        """Write this rank's pieces of the adapter tensors (PEFT's names, every one of
        them) into its shards (no communication)."""
        fsdp2.load_canonical(self.model, self._adapters, self.rank, adapters)

    def export_adapters(self) -> dict[str, Tensor]:
        """Every adapter tensor (PEFT's names) on every rank (collective; bitwise)."""
        return fsdp2.export_canonical(self.model, self._adapters)

    def adapter_local_state(self) -> dict[str, Tensor]:
        """This rank's live adapter shards by ``adapter_layout`` name (checkpoint state)."""
        return {
            lt.name: _local(self._tensors[lt.name]).detach()
            for lt in self._adapters.local_tensors(self.rank)
        }
