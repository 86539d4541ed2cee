"""How ``MegatronEngine`` runs Megatron-Core (choices that leave the layout and the
step's results unchanged): activation recompute, gradient-reduce overlap, DDP bucket
size, and the FP8 recipe it refuses.

The record is validated when built; :func:`megatron_option_fields` turns it into the
``TransformerConfig`` and ``DistributedDataParallelConfig`` fields the engine passes to
Megatron-Core, refusing, in one line with the reason, what does not run. Both are pure
(the engine passes in whether Transformer Engine is installed and its device).

- **Recompute** uses Megatron-Core's own settings: ``recompute_granularity="full"``
  recomputes whole transformer layers (``recompute_method`` ``"uniform"``: groups of
  ``recompute_num_layers`` layers; ``"block"``: the first ``recompute_num_layers`` layers
  of each pipeline chunk); ``"selective"`` recomputes the submodules named in
  ``recompute_modules`` (``core_attn``, ``mlp``, ``layernorm``, ``moe``,
  ``shared_experts``, ``mla_up_proj``).
- **overlap_grad_reduce**: DDP all-reduces each gradient bucket as soon as backward has
  filled it (asynchronously), instead of all at once after backward; ``bucket_size``
  (elements; ``None``: Megatron's default, at least 40M) sets how many buckets there are.
- **overlap_param_gather** is refused: it overlaps the distributed optimizer's parameter
  all-gather, and the engine steps ``torch.optim.AdamW`` over whole local parameters
  (Megatron's ``DistributedOptimizer`` does not build on CPU: its ``MixedPrecisionOptimizer``
  base allocates a ``device='cuda'`` tensor; DDP with ``overlap_param_gather`` and
  ``use_distributed_optimizer`` itself builds).
- **fp8_recipe** (Megatron's ``fp8_recipe`` names) is refused: FP8 GEMMs in Megatron-Core
  run in Transformer Engine's layers on an FP8 GPU, and the engine builds the local
  (TE-free) layer spec.
"""

from typing import Any

import attrs

from areal_fn.errors import LayoutError, SpecError

__all__ = ["FP8_RECIPES", "RECOMPUTE_MODULES", "MegatronRunOptions", "megatron_option_fields"]

#: Megatron-Core 0.16's selective recompute modules that build without Transformer
#: Engine (``moe_act`` needs grouped GEMM, which needs CUDA).
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "shared_experts", "mla_up_proj")
#: Megatron-Core's ``fp8_recipe`` names.
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(_inst: object, attr: "attrs.Attribute[str | None]", value: object) -> None:
        if value is not None and value not in choices:
            raise SpecError(
                f"MegatronRunOptions.{attr.name}={value!r} is not one of {choices} or None"
            )

    return check


def _positive_or_none(_inst: object, attr: "attrs.Attribute[int | None]", value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpecError(f"MegatronRunOptions.{attr.name}={value!r} must be None or an int >= 1")


def _modules(_inst: object, _attr: object, value: tuple[str, ...]) -> None:
    bad = [m for m in value if m not in RECOMPUTE_MODULES]
    if bad or not value:
        raise SpecError(
            f"MegatronRunOptions.recompute_modules={value!r}: "
            + (f"{bad} not recomputable here" if bad else "empty")
            + f"; choose from {RECOMPUTE_MODULES} (moe_act needs grouped GEMM, a CUDA kernel)"
        )


@attrs.frozen(kw_only=True)
class MegatronRunOptions:
    """Megatron-Core run options of ``MegatronEngine`` (see the module docstring).

    Full recompute needs ``recompute_method`` and ``recompute_num_layers``, selective
    neither (Megatron-Core's rules, checked here first)."""

    recompute_granularity: str | None = attrs.field(
        default=None, validator=_one_of(("full", "selective"))
    )
    recompute_method: str | None = attrs.field(
        default=None, validator=_one_of(("uniform", "block"))
    )
    recompute_num_layers: int | None = attrs.field(default=None, validator=_positive_or_none)
    recompute_modules: tuple[str, ...] = attrs.field(
        default=("core_attn",), converter=tuple, validator=_modules
    )
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    fp8_recipe: str | None = attrs.field(default=None, validator=_one_of(FP8_RECIPES))

    def __attrs_post_init__(self) -> None:
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise SpecError(
                "MegatronRunOptions: recompute_granularity='full' needs recompute_method "
                f"('uniform' or 'block') and recompute_num_layers, got {self.recompute_method!r} "
                f"and {self.recompute_num_layers!r}; e.g. recompute_method='uniform', "
                "recompute_num_layers=1 (every layer)"
            )
        if not full and (self.recompute_method, self.recompute_num_layers) != (None, None):
            raise SpecError(
                f"MegatronRunOptions: recompute_method={self.recompute_method!r} and "
                f"recompute_num_layers={self.recompute_num_layers!r} apply to "
                f"recompute_granularity='full' only (it is {self.recompute_granularity!r}); "
                "leave them None"
            )


def _refusal(
    options: MegatronRunOptions, *, mla: bool, te_installed: bool, device_type: str
) -> str:
    """What of ``options`` does not run ('' when all of it does)."""
    selective = options.recompute_granularity == "selective"
    if selective and "mla_up_proj" in options.recompute_modules and not mla:
        return (
            "MegatronEngine: recompute_modules 'mla_up_proj' recomputes multi-latent "
            "attention's up projection, and this model has none; drop it"
        )
    if options.overlap_param_gather:
        return (
            "MegatronEngine: overlap_param_gather overlaps the distributed optimizer's "
            "parameter all-gather (use_distributed_optimizer=True); the engine steps "
            "torch.optim.AdamW over whole local parameters, as Megatron's DistributedOptimizer "
            "does not build on CPU (its MixedPrecisionOptimizer base allocates "
            "torch.tensor([0], device='cuda'): 'Torch not compiled with CUDA enabled'); use "
            "overlap_grad_reduce alone"
        )
    if options.fp8_recipe is not None:
        missing = [
            *([] if te_installed else ["Transformer Engine (not installed)"]),
            *([] if device_type == "cuda" else [f"an FP8 GPU (device_type={device_type!r})"]),
        ]
        return (
            f"MegatronEngine: fp8_recipe={options.fp8_recipe!r} runs Megatron-Core's FP8 "
            "GEMMs in Transformer Engine's layers on an FP8 GPU (compute capability >= 8.9)"
            + (f"; missing here: {', '.join(missing)}" if missing else "")
            + "; the engine builds Megatron's local (TE-free) layer spec, whose linears "
            "do not run FP8; train in fp32 or fp16 (precision=)"
        )
    return ""


def megatron_option_fields(
    options: MegatronRunOptions, *, mla: bool, te_installed: bool, device_type: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(TransformerConfig fields, DistributedDataParallelConfig fields)`` for
    ``options``; raises :class:`~areal_fn.errors.LayoutError` for what does not run."""
    problem = _refusal(options, mla=mla, te_installed=te_installed, device_type=device_type)
    if problem:
        raise LayoutError(problem)
    config: dict[str, Any] = {}
    if options.recompute_granularity is not None:
        config["recompute_granularity"] = options.recompute_granularity
        config["recompute_method"] = options.recompute_method
        config["recompute_num_layers"] = options.recompute_num_layers
        config["recompute_modules"] = list(options.recompute_modules)
    ddp: dict[str, Any] = {"overlap_grad_reduce": options.overlap_grad_reduce}
    if options.bucket_size is not None:
        ddp["bucket_size"] = options.bucket_size
    return config, ddp
