"""Build Megatron-Core parallel state and tiny ``GPTModel`` s from explicit inputs.

Everything here runs under ``torchrun`` (one process per rank) and works on CPU with
gloo when :mod:`areal_fn.runtime.megatron.cpu` is enabled (:func:`megatron_session`
enables it for you). The model architecture comes in as a plain mapping of
Hugging Face-style fields (see :data:`ARCH_FIELDS`); the parallel sizes as a
:class:`MegatronSizes` record.

Typical use in a worker::

    sizes = MegatronSizes(tp=2, pp=2, vpp=2)
    with megatron_session(sizes, seed=0):
        config = transformer_config(arch, sizes)
        chunks = build_model_chunks(arch, config)
        ...

The model uses Megatron-Core's *local* layer spec (``get_gpt_layer_local_spec``):
plain ``ColumnParallelLinear`` / ``RowParallelLinear``, ``torch.nn.RMSNorm``, unfused
dot-product attention, ``SequentialMLP`` experts. The TransformerEngine spec cannot be
built without TransformerEngine.
"""

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from areal_fn.errors import LayoutError
from areal_fn.runtime.megatron import cpu as megatron_cpu
from areal_fn.typecheck import beartype

__all__ = [
    "ARCH_FIELDS",
    "MegatronSizes",
    "build_gpt_model",
    "build_model_chunks",
    "destroy_parallel_state",
    "forward_logits",
    "gather_tp_logits",
    "init_distributed",
    "init_parallel_state",
    "layer_spec",
    "local_layer_offsets",
    "megatron_session",
    "pipeline_forward_logits",
    "rope_kwargs",
    "transformer_config",
]

#: The architecture fields read from the ``arch`` mapping (``None`` = optional).
ARCH_FIELDS: Mapping[str, str] = {
    "hidden_size": "int",
    "num_layers": "int (HF num_hidden_layers)",
    "num_attention_heads": "int",
    "num_key_value_heads": "int",
    "head_dim": "int or None (default hidden_size // num_attention_heads)",
    "intermediate_size": "int (dense MLP width)",
    "vocab_size": "int",
    "max_position_embeddings": "int or None (default 4096)",
    "tie_word_embeddings": "bool",
    "qkv_bias": "bool (qwen2)",
    "qk_norm": "bool (qwen3: RMSNorm over head_dim on q and k)",
    "rms_norm_eps": "float",
    "rope_theta": "float",
    "rope_scaling": "mapping, (key, value) pairs or None (only rope_type 'llama3'; see rope_kwargs)",
    "num_experts": "int or None (MoE when set)",
    "moe_intermediate_size": "int or None (expert MLP width)",
    "num_experts_per_tok": "int or None (router top-k)",
    "norm_topk_prob": "bool or None (renormalise top-k probabilities; default True)",
    "moe_layer_pattern": "sequence of 0/1 per layer or None (all layers MoE)",
}

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
    for ``sizes``; both undone on exit.

    Initialises the default process group first if needed (left up on exit, so that
    one launch can run many sessions). Build and run models inside the block: on CPU
    they need the redirections, which are removed on exit.
    """
    use_cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    with megatron_cpu.cpu_megatron() if use_cpu else contextlib.nullcontext():
        init_distributed(backend="gloo" if use_cpu else "nccl")
        init_parallel_state(sizes, seed=seed, create_gloo_process_groups=create_gloo_process_groups)
        try:
            yield
        finally:
            destroy_parallel_state()


# -------------------------------------------------------------------- models


def _field(arch: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = arch.get(name, default)
    return default if value is None else value


@beartype
def transformer_config(
    arch: Mapping[str, Any],
    sizes: MegatronSizes,
    *,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    pipeline_model_parallel_layout: str | None = None,
    moe_grouped_gemm: bool = False,
    params_dtype: torch.dtype = torch.float32,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """A CPU-safe fp32 ``TransformerConfig`` for ``arch`` under ``sizes``.

    Fusions off (rope, masked softmax, bias-activation, bias-dropout, persistent
    layer norm, gradient-accumulation), no dropout, ``use_cpu_initialization``,
    RMSNorm, SwiGLU, no linear biases (qkv bias from ``arch["qkv_bias"]``), allgather
    MoE dispatcher, no load-balancing loss. Uneven pipeline stages: either
    ``num_layers_in_first/last_pipeline_stage`` or a ``pipeline_model_parallel_layout``
    string such as ``"Et|tt|tL"`` (E = embedding, t = layer, L = loss, ``|`` = next
    stage, virtual stages included). ``overrides`` are further ``TransformerConfig``
    fields, applied last (e.g. ``{"moe_token_dispatcher_type": "alltoall"}``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads = arch["num_attention_heads"]
    hidden = arch["hidden_size"]
    num_experts = arch.get("num_experts")
    moe: dict[str, Any] = {}
    if num_experts:
        pattern = arch.get("moe_layer_pattern")
        moe = {
            "num_moe_experts": num_experts,
            "moe_ffn_hidden_size": arch["moe_intermediate_size"],
            "moe_router_topk": arch["num_experts_per_tok"],
            "moe_router_pre_softmax": not _field(arch, "norm_topk_prob", True),
            "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather",
            "moe_grouped_gemm": moe_grouped_gemm,
            "moe_layer_freq": 1 if pattern is None else [int(bool(x)) for x in pattern],
            "moe_shared_expert_intermediate_size": None,
            "moe_router_dtype": "fp32",
        }
    fields: dict[str, Any] = dict(
        num_layers=arch["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=arch["num_key_value_heads"],
        kv_channels=_field(arch, "head_dim", hidden // heads),
        ffn_hidden_size=arch["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=arch["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(arch.get("qkv_bias", False)),
        qk_layernorm=bool(arch.get("qk_norm", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # parallelism
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        sequence_parallel=False,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        pipeline_model_parallel_layout=pipeline_model_parallel_layout,
        pipeline_dtype=params_dtype,
        # CPU: no fused kernels, fp32, weights created on CPU
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=True,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # gloo matches same-peer p2p messages in posting order, and the interleaved
        # schedule posts both directions between two pipeline ranks in one batch in
        # opposite orders (pp=2): batched p2p would silently swap activations and
        # gradients. Unbatched p2p sends the two directions over different groups.
        batch_p2p_comm=not (dist.is_initialized() and dist.get_backend() == "gloo"),
        **moe,
    )
    fields.update(overrides or {})
    return TransformerConfig(**fields)


@beartype
def layer_spec(arch: Mapping[str, Any], config: Any, *, vp_stage: int | None = None) -> Any:
    """Megatron-Core's local (TransformerEngine-free) spec for ``arch``.

    Dense models: the single layer spec ``get_gpt_layer_local_spec`` (every layer the
    same). MoE models: ``get_gpt_decoder_block_spec`` with ``use_transformer_engine=False``,
    the per-layer specs of this pipeline stage (chunk ``vp_stage``), which is what honours
    ``moe_layer_freq``; the single MoE layer spec would make every layer MoE.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if arch.get("num_experts"):
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
    return get_gpt_layer_local_spec(
        qk_layernorm=bool(arch.get("qk_norm", False)), normalization="RMSNorm"
    )


def _rotary_base(theta: float) -> int | float:
    return int(theta) if float(theta).is_integer() else theta


#: The Llama 3 rope parameters Megatron-Core's ``RotaryEmbedding`` fixes (only the factor
#: is an argument); every Llama 3.1 / 3.2 config has these values.
MCORE_LLAMA3_ROPE: Mapping[str, float] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@beartype
def rope_kwargs(arch: Mapping[str, Any]) -> dict[str, Any]:
    """``GPTModel``'s rope-scaling arguments for ``arch["rope_scaling"]``.

    ``rope_scaling`` is absent, ``None``, a mapping or ``(key, value)`` pairs (as
    :class:`~areal_fn.model.spec.ModelSpec` holds it). Megatron-Core applies one rope scaling,
    Llama 3's (``rope_type`` ``llama3``), with :data:`MCORE_LLAMA3_ROPE` fixed:
    ``{"rope_scaling": True, "rope_scaling_factor": factor}``. No scaling (or
    ``rope_type`` ``default``): ``{"rope_scaling": False}``. Anything else GPTModel would
    ignore, computing other rotations than the config asks for: ``LayoutError``.
    """
    raw = arch.get("rope_scaling")
    items: dict[str, Any] = dict(raw.items() if isinstance(raw, Mapping) else raw or ())
    kind = items.get("rope_type", items.get("type", "default"))
    partial = items.get("partial_rotary_factor")
    if partial not in (None, 1):
        raise LayoutError(
            f"rope scaling {items} has partial_rotary_factor={partial!r}; the Megatron builder "
            f"rotates every head dim (rotary_percent=1.0); use a config without it"
        )
    if kind == "default":
        return {"rope_scaling": False}
    if kind == "llama3":
        wrong = [f"{k}={items.get(k)!r}" for k, v in MCORE_LLAMA3_ROPE.items() if items.get(k) != v]
        factor = items.get("factor")
        if not wrong and isinstance(factor, int | float) and factor > 0:
            return {"rope_scaling": True, "rope_scaling_factor": float(factor)}
        raise LayoutError(
            f"llama3 rope scaling {items} has {', '.join(wrong) or f'factor={factor!r}'}; "
            f"Megatron-Core's GPTModel applies llama3 scaling with a factor > 0 and "
            f"{dict(MCORE_LLAMA3_ROPE)} fixed, so it would compute other rotations; train "
            f"this model with the fsdp backend"
        )
    raise LayoutError(
        f"rope scaling {items} (rope_type={kind!r}) is not applied by Megatron-Core's "
        f"GPTModel, which applies rope_type 'llama3' only, so it would compute other "
        f"rotations than the config asks for; train this model with the fsdp backend, or use "
        f"a model without rope scaling"
    )


@beartype
def build_gpt_model(
    arch: Mapping[str, Any],
    config: Any,
    *,
    vp_stage: int | None = None,
    vocab_size: int | None = None,
    parallel_output: bool = True,
) -> Any:
    """One ``GPTModel`` (one virtual-pipeline chunk when ``vp_stage`` is given).

    ``vocab_size`` defaults to ``arch["vocab_size"]``; pass a padded size to mirror a
    trainer that pads the vocabulary (Megatron-Core itself does not pad).
    ``parallel_output=True`` leaves logits vocab-sharded across tensor parallelism.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    ignore_virtual = vp_stage is None
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    spec = layer_spec(arch, config, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch["vocab_size"] if vocab_size is None else vocab_size,
        max_sequence_length=_field(arch, "max_position_embeddings", 4096),
        pre_process=pre,
        post_process=post,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(arch.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rotary_base(arch["rope_theta"]),
        vp_stage=vp_stage,
        **rope_kwargs(arch),
    )


@beartype
def build_model_chunks(
    arch: Mapping[str, Any],
    config: Any,
    *,
    vocab_size: int | None = None,
    parallel_output: bool = True,
) -> list[Any]:
    """This rank's model chunks: ``vpp`` of them under virtual pipeline, else one."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages: Sequence[int | None] = [None] if vpp is None else range(vpp)
    return [
        build_gpt_model(
            arch, config, vp_stage=v, vocab_size=vocab_size, parallel_output=parallel_output
        )
        for v in stages
    ]


@beartype
def local_layer_offsets(config: Any) -> list[int]:
    """Global index of each chunk's first decoder layer on this rank.

    Parameter names hold local indices (``decoder.layers.0`` on every stage); global
    layer ``i`` of chunk ``c`` is ``offsets[c] + i``.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = config.virtual_pipeline_model_parallel_size
    stages: Sequence[int | None] = [None] if vpp is None else range(vpp)
    return [int(get_transformer_layer_offset(config, vp_stage=v)) for v in stages]


# ------------------------------------------------------------------- forward


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
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    with _inference([model]):
        return model(input_ids, position_ids, _causal_mask(seq))


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
    micro = list(input_ids.split(mbs))
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
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
    return torch.cat([o["logits"] for o in outputs], dim=0)
