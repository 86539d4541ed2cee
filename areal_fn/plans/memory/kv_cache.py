"""The KV cache an inference engine (SGLang, vLLM) keeps, per rank of a deployment.

Per token and decoder layer a rank caches, in ``dtype`` (the model's by default):

- grouped-query / multi-head attention: keys and values of its KV heads,
  ``2 * kv_local * head_dim`` elements, where ``kv_local = num_key_value_heads / tp``
  when ``tp`` divides the KV heads, else 1 (``tp`` a multiple of the KV heads: each
  head replicated over ``tp / num_key_value_heads`` ranks, as the engines do);
- multi-latent attention (:attr:`~areal_fn.model.spec.ModelSpec.is_mla`, DeepSeek-V3):
  the compressed latent and the rotary key, ``kv_lora_rank + qk_rope_head_dim``
  elements, no heads, the same on every tensor-parallel rank.

A rank of pipeline stage ``s`` holds the layers of that stage (the engines' even
split, :func:`~areal_fn.layouts.inference.layer_stage`), for ``batch`` sequences of
``context_len`` tokens each, per data-parallel replica (every replica serves its own
batch). A sliding-window layer (:attr:`~areal_fn.model.spec.ModelSpec.sliding_layers`:
gpt-oss, OLMo 3, Gemma 3) keeps the last ``sliding_window`` tokens of a sequence only,
as vLLM's and SGLang's sliding-window caches do: ``min(context_len, sliding_window)``
tokens. A gated-delta-net linear-attention layer
(:attr:`~areal_fn.model.spec.ModelSpec.linear_attention`: Qwen3-Next, Qwen3.5) caches
no keys or values: it keeps one state per sequence whatever the context length, every
value head's ``key_head_dim x value_head_dim`` matrix and the conv's last
``conv_kernel - 1`` inputs (:attr:`~areal_fn.model.linear_attention.LinearAttention.state_numel`),
split over ``tp`` by key-head groups as vLLM splits the layer (``tp`` must divide
``linear_num_key_heads``), counted in ``dtype``. A DeepSeek-sparse-attention layer
with an indexer of its own (:attr:`~areal_fn.model.spec.ModelSpec.indexer_layers`:
DeepSeek-V3.2, GLM-5) also caches the indexer's key, ``index_head_dim`` elements per
token (counted in ``dtype``; DeepSeek's kernels keep it in FP8 with a scale). The
engines' page rounding and the CUDA graphs' buffers are left out.
"""

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.inference import layer_stage
from areal_fn.model.linear_attention import is_linear_layer
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import DTYPE_BYTES, dtype_name
from areal_fn.strategy.allocation import Backend
from areal_fn.strategy.coerce import Strategy, as_dims
from areal_fn.typecheck import beartype

__all__ = ["KVCache", "kv_cache"]


@attrs.frozen(kw_only=True)
class KVCache:
    """The KV cache of one deployment: bytes per token and layer on one rank, the
    layers each pipeline stage holds, and ``batch`` sequences of ``context_len``."""

    context_len: int
    batch: int
    dtype: str
    #: elements one rank caches per token and layer (see the module docstring)
    elements_per_token_layer: int
    #: decoder layers held by each pipeline stage, stage 0 first
    stage_layers: tuple[int, ...]
    #: of those, the sliding-window layers per stage (empty: none), and their window
    stage_sliding: tuple[int, ...] = ()
    sliding_window: int = 0
    #: of those, the linear-attention layers per stage (empty: none), and the elements
    #: of one such layer's state per sequence on a rank
    stage_linear: tuple[int, ...] = ()
    linear_state_elements: int = 0
    #: of those, the layers with an indexer of their own per stage (empty: none), and
    #: the elements of the indexer's key per token
    stage_indexer: tuple[int, ...] = ()
    indexer_elements: int = 0

    @property
    def window_tokens(self) -> int:
        """Tokens of a sequence a sliding-window layer keeps."""
        return min(self.context_len, self.sliding_window)

    @property
    def bytes_per_token_layer(self) -> int:
        return self.elements_per_token_layer * DTYPE_BYTES[self.dtype]

    def stage_bytes(self, stage: int) -> int:
        """Bytes a rank of pipeline stage ``stage`` keeps for the whole batch."""
        sliding = self.stage_sliding[stage] if self.stage_sliding else 0
        linear = self.stage_linear[stage] if self.stage_linear else 0
        tokens = (self.stage_layers[stage] - sliding - linear) * self.context_len
        tokens += sliding * self.window_tokens
        state = linear * self.linear_state_elements * DTYPE_BYTES[self.dtype]
        indexed = self.stage_indexer[stage] if self.stage_indexer else 0
        state += indexed * self.context_len * self.indexer_elements * DTYPE_BYTES[self.dtype]
        return self.batch * (tokens * self.bytes_per_token_layer + state)

    @property
    def max_bytes(self) -> int:
        """The largest per-rank cache (the stage with the most layers)."""
        return max(self.stage_bytes(s) for s in range(len(self.stage_layers)))

    def __str__(self) -> str:
        return (
            f"KV cache {self.batch} x {self.context_len} tokens in {self.dtype}: "
            f"{self.bytes_per_token_layer:,} bytes per token and layer on a rank, "
            f"at most {self.max_bytes:,} bytes per rank"
        )


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise SpecError(f"kv_cache: {name}={value} must be >= 1; pass e.g. {name}=1")


@beartype
def kv_cache(
    model: ModelSpec,
    dims: Strategy,
    *,
    context_len: int,
    batch: int = 1,
    dtype: str | None = None,
) -> KVCache:
    """The KV cache ``batch`` sequences of ``context_len`` tokens take on each rank of
    the inference deployment ``dims`` (``ParallelDims`` or an sglang / vllm allocation
    string or component); formula in the module docstring."""
    d = as_dims(dims, caller="kv_cache", backends=(Backend.SGLANG, Backend.VLLM))
    _positive("context_len", context_len)
    _positive("batch", batch)
    name = dtype_name(dtype or model.dtype)
    if model.is_mla:
        per = model.kv_lora_rank + model.qk_rope_head_dim
    else:
        kv = model.num_key_value_heads
        if kv % d.tp and d.tp % kv:
            raise SpecError(
                f"kv_cache: tp={d.tp} neither divides nor is a multiple of "
                f"num_key_value_heads={kv}; use tp dividing {kv} or a multiple of it"
            )
        per = 2 * max(1, kv // d.tp) * model.head_dim
    if d.pp > model.num_layers:
        raise SpecError(
            f"kv_cache: pp={d.pp} exceeds the model's {model.num_layers} layers; use pp <= "
            f"{model.num_layers}"
        )
    layers, sliding, linear = [0] * d.pp, [0] * d.pp, [0] * d.pp
    for i in range(model.num_layers):
        stage = layer_stage(i, model.num_layers, d.pp)
        layers[stage] += 1
        sliding[stage] += bool(model.sliding_layers and model.sliding_layers[i])
        linear[stage] += is_linear_layer(model, i)
    indexer = [0] * d.pp
    for i, own in enumerate(model.indexer_layers):
        indexer[layer_stage(i, model.num_layers, d.pp)] += own
    return KVCache(
        context_len=context_len,
        batch=batch,
        dtype=name,
        elements_per_token_layer=per,
        stage_layers=tuple(layers),
        stage_sliding=tuple(sliding) if any(sliding) else (),
        sliding_window=model.sliding_window if any(sliding) else 0,
        stage_linear=tuple(linear) if any(linear) else (),
        linear_state_elements=_linear_state(model, d.tp) if any(linear) else 0,
        stage_indexer=tuple(indexer) if any(indexer) else (),
        indexer_elements=model.index_head_dim,
    )


def _linear_state(model: ModelSpec, tp: int) -> int:
    """One linear-attention layer's state per sequence on one of ``tp`` ranks."""
    la = model.linear_attention
    assert la is not None  # called for models with linear layers
    if la.key_heads % tp:
        raise SpecError(
            f"kv_cache: tp={tp} does not divide linear_num_key_heads={la.key_heads}; the "
            f"engines split a linear-attention layer by key-head groups; use tp dividing "
            f"{la.key_heads}"
        )
    return la.state_numel // tp
