"""Where Megatron-Core's ``dist_checkpointing`` stores each tensor of a ``GPTModel``.

Megatron-Core stores every tensor TP-, PP- and EP-unsharded under a *sharded key*,
with leading dims for the indices it removed from the parameter name:

- decoder layers, when every layer is alike (a dense model, or ``moe_layer_freq=1``),
  are *stacked*: ``decoder.layers.3.mlp.linear_fc2.weight`` is row 3 of
  ``decoder.layers.mlp.linear_fc2.weight`` ``[num_layers, ...]``; when dense and MoE
  layers mix (``moe_layer_freq`` a list) each layer keeps its own key
  (``decoder.layers.3.mlp.linear_fc2.weight``, *per-layer*);
- routed experts: ``mlp.experts.local_experts.{i}.linear_fc1.weight`` of EP rank ``r``
  is expert ``r * local + i`` of ``mlp.experts.experts.linear_fc1.weight``
  ``[num_experts, ...]`` (after the layer dim when stacked);
- every linear module (``linear_qkv``, ``linear_fc1``, ...) also has an
  ``_extra_state`` object with the same leading offsets.

Key names are those of the layer spec that built the model. The Transformer-Engine
spec (``te``, Megatron-LM's default on GPUs) names them as its parameters are named
(layer norms fused into ``linear_qkv`` / ``linear_fc1``, a MoE layer's own
``pre_mlp_layernorm``). The local spec (``local``) maps its parameters onto those
names with ``sharded_state_dict_keys_map``: ``input_layernorm.`` ->
``self_attention.linear_qkv.layer_norm_`` and ``pre_mlp_layernorm.`` ->
``mlp.linear_fc1.layer_norm_`` in every layer, MoE layers included (multi-latent
attention layers keep their own names). Dense models store the same keys under
both specs.
"""

import re
from typing import Literal

import attrs

from areal_fn.errors import CheckpointError
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec

__all__ = ["LayerKeys", "LayerSpec", "McoreKey", "mcore_keys", "mcore_layout", "pick_keys"]

LayerSpec = Literal["te", "local"]
LayerKeys = Literal["stacked", "per-layer"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
#: the local spec's ``sharded_state_dict_keys_map`` (not applied to MLA layers)
_LOCAL_KEYS_MAP = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


@attrs.frozen(kw_only=True)
class McoreKey:
    """Where one local tensor of the unsharded layout lies in a Megatron checkpoint:
    the stored tensor ``key``, its leading dims (``prefix_sizes``) and this tensor's
    index along each (``prefix``)."""

    key: str
    prefix: tuple[int, ...]
    prefix_sizes: tuple[int, ...]

    @property
    def extra_state(self) -> str | None:
        """The unique key of the module's ``_extra_state`` object (linear modules of
        decoder layers only), else None."""
        if not self.key.startswith("decoder.layers.") or not self.key.endswith(".weight"):
            return None
        module = self.key.removesuffix(".weight")
        if not module.rsplit(".", 1)[-1].startswith("linear_"):
            return None
        offsets, sizes = (self.prefix, self.prefix_sizes) if self.prefix else ((0,), (1,))
        return (
            f"{module}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, sizes))}"
        )


def mcore_layout(model: ModelSpec, spec: LayerSpec = "te") -> Layout:
    """Megatron-Core's checkpoint view of ``model``: TP-, PP- and EP-unsharded, every
    expert local to the one rank, the parameter names of ``spec``'s layers,
    vocabulary unpadded (the stored rows beyond it are padding)."""
    from areal_fn.layouts.megatron import megatron_layout
    from areal_fn.strategy.allocation import ParallelDims

    if model.linear_attention is not None:
        raise CheckpointError(
            f"{model.model_type}: Megatron-Core's dist_checkpointing stores each GatedDeltaNet's "
            "in_proj and conv1d cut into query/key/value/z/beta/alpha sub-tensors, keys this "
            "interop does not map, and its Transformer-Engine out_norm holds w - 1; use the "
            "per-rank files (areal-fn convert --format rank-files) or HF checkpoints instead"
        )
    return megatron_layout(model, ParallelDims(), naming=spec, vocab_divisible_by=1)


def _local_key(rest: str, *, mla: bool) -> str:
    if mla:
        return rest
    for old, new in _LOCAL_KEYS_MAP:
        if rest.startswith(old):
            return new + rest.removeprefix(old)
    return rest


def mcore_keys(model: ModelSpec, spec: LayerSpec, layer_keys: LayerKeys) -> dict[str, McoreKey]:
    """Layer-spec-``spec`` parameter name (of :func:`mcore_layout`) -> where Megatron
    stores it, layers ``stacked`` or ``per-layer``."""
    if layer_keys == "stacked" and len(set(model.moe_layers)) > 1:
        dense = [i for i, moe in enumerate(model.moe_layers) if not moe]
        raise CheckpointError(
            f"layer_keys='stacked': {model.model_type} mixes dense layers {dense} with MoE "
            "layers, and Megatron-Core stacks layers only when all are alike; use "
            "layer_keys='per-layer' (what Megatron-Core stores for such a model)"
        )
    out: dict[str, McoreKey] = {}
    for lt in mcore_layout(model, spec).local_tensors(0):
        m = _LAYER.match(lt.name)
        if m is None:
            out[lt.name] = McoreKey(key=lt.name, prefix=(), prefix_sizes=())
            continue
        layer, rest = int(m.group(1)), m.group(2)
        prefix: tuple[int, ...] = ()
        sizes: tuple[int, ...] = ()
        e = _EXPERT.match(rest)
        if e is not None:
            rest = f"mlp.experts.experts.{e.group(2)}"
            prefix, sizes = (int(e.group(1)),), (model.num_experts,)
        if spec == "local":
            rest = _local_key(rest, mla=model.is_mla)
        if layer_keys == "stacked":
            key, prefix, sizes = (
                f"decoder.layers.{rest}",
                (layer, *prefix),
                (model.num_layers, *sizes),
            )
        else:
            key = f"decoder.layers.{layer}.{rest}"
        out[lt.name] = McoreKey(key=key, prefix=prefix, prefix_sizes=sizes)
    return out


def default_layer_keys(model: ModelSpec) -> LayerKeys:
    """``stacked`` when every layer is alike, ``per-layer`` when dense and MoE layers
    mix: what Megatron-Core stores for ``moe_layer_freq`` ``1`` and a list."""
    return "per-layer" if len(set(model.moe_layers)) > 1 else "stacked"


def pick_keys(
    model: ModelSpec, stored: "set[str] | frozenset[str]", where: str
) -> tuple[LayerSpec, LayerKeys, dict[str, McoreKey]]:
    """The layer spec and layer keys a checkpoint holding ``stored`` keys was saved
    with: the first whose every key is there; else ``CheckpointError`` naming what the
    closest one misses."""
    best: tuple[int, str, list[str]] | None = None
    for spec in ("te", "local"):
        for layer_keys in ("stacked", "per-layer"):
            if layer_keys == "stacked" and len(set(model.moe_layers)) > 1:
                continue
            keys = mcore_keys(model, spec, layer_keys)  # type: ignore[arg-type]
            missing = sorted({k.key for k in keys.values()} - set(stored))
            if not missing:
                return spec, layer_keys, keys  # type: ignore[return-value]
            if best is None or len(missing) < best[0]:
                best = (len(missing), f"{spec} layer spec, {layer_keys} layers", missing)
    assert best is not None
    _, closest, missing = best
    raise CheckpointError(
        f"{where}: the Megatron checkpoint lacks {len(missing)} tensors a GPTModel of this "
        f"{model.model_type} model stores (closest: the {closest}; missing {missing[:4]}); "
        "it was saved from another model or with other options"
    )
