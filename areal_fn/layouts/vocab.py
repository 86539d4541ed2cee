"""Megatron's vocabulary padding rule, and which tensors are vocabulary tensors.

Megatron pads the embedding and output layer to a multiple of
``make_vocab_size_divisible_by * tensor_model_parallel_size`` (its
``_vocab_size_with_padding``: round ``vocab_size`` up to that multiple; a vocabulary
already on a multiple is not padded). The padded rows have no canonical source: they
are pieces of padding in a layout, never checkpoint data.
"""

import functools

from areal_fn.errors import SpecError
from areal_fn.model.spec import ModelSpec
from areal_fn.typecheck import beartype


@beartype
def padded_vocab_size(vocab_size: int, *, tp: int, divisible_by: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tp`` (Megatron's rule).

    >>> padded_vocab_size(151936, tp=8)  # 151936 = 148.375 * 1024
    152576
    >>> padded_vocab_size(128256, tp=1)  # 128256 = 1002 * 128: no padding
    128256
    >>> padded_vocab_size(128256, tp=8)
    129024
    """
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("divisible_by", divisible_by)):
        if isinstance(value, bool) or value < 1:
            raise SpecError(f"padded_vocab_size: {name}={value!r} must be an int >= 1")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@beartype
def vocab_padding(vocab_size: int, *, tp: int, divisible_by: int = 128) -> int:
    """Number of padding rows Megatron adds: ``padded_vocab_size(...) - vocab_size``."""
    return padded_vocab_size(vocab_size, tp=tp, divisible_by=divisible_by) - vocab_size


@functools.lru_cache(maxsize=16)
def vocab_tensors(model: ModelSpec) -> frozenset[str]:
    """The canonical tensors with a row per token (padded and split like the vocabulary):
    the family's embedding and output layer (``Family.outer``) and each MTP layer's own
    embedding copy and head."""
    outer = model.family.outer
    block = model.family.mtp
    leaves = block.vocab if block is not None else ()
    mtp = {f"model.layers.{i}.{leaf}" for i in model.mtp_layer_ids for leaf in leaves}
    return frozenset({outer.embedding, outer.output, *mtp})
