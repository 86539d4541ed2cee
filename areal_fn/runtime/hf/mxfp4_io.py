"""MXFP4 checkpoints (gpt-oss's published experts), read as the model's dtype.

A config whose ``quantization_config`` says ``quant_method: mxfp4`` stores each
quantised stacked expert weight ``X`` (``mlp.experts.gate_up_proj`` ``[E, H, 2I]``,
``mlp.experts.down_proj`` ``[E, I, H]``) as ``X_blocks`` (uint8 ``[E, out, in / 32,
16]``) and ``X_scales`` (uint8 ``[E, out, in / 32]``): the weight transposed, its rows cut
in groups of 32 (:mod:`~areal_fn.plans.mxfp4`). :class:`Mxfp4Weights` shows ``X`` under
its own name and shape in the config's ``torch_dtype`` and reads a box of it from the
groups the box touches.
"""

from collections.abc import Callable, Mapping

import attrs
import torch

from areal_fn.errors import ConversionError
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.mxfp4 import dequantize_mxfp4
from areal_fn.plans.tensor_check import listing
from areal_fn.sharding.box import Box

__all__ = ["Mxfp4Weights", "mxfp4_weights", "stored_code"]

#: safetensors' names of the dtypes of quantised weights, scales and blocks
_SAFETENSORS = {"float8_e4m3fn": "F8_E4M3", "float32": "F32", "uint8": "U8"}


def stored_code(dtype: str) -> str:
    """safetensors' name (``F8_E4M3``) of a dtype as a reader reports it (``U8`` as it
    is, ``torch.uint8`` from a tensor)."""
    return _SAFETENSORS.get(dtype.removeprefix("torch."), dtype)


_BLOCKS, _SCALES = "_blocks", "_scales"
_GROUP = 32


@attrs.frozen(kw_only=True)
class Mxfp4Weights:
    """The MXFP4 weights of a checkpoint (by the name shown) and the dtype they read as."""

    dtype: torch.dtype
    weights: tuple[str, ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.weights)

    @property
    def hidden(self) -> frozenset[str]:
        return frozenset(w + s for w in self.weights for s in (_BLOCKS, _SCALES))

    def shape(self, name: str, stored: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        """``[E, in, out]`` of blocks ``[E, out, in / 32, 16]``."""
        e, out, groups, _ = stored(name + _BLOCKS)
        return (e, groups * _GROUP, out)

    def read(self, name: str, box: Box, stored: Callable[[str, Box], torch.Tensor]) -> torch.Tensor:
        """``box`` (``[E, in, out]`` coordinates) of ``name``, from the groups it touches."""
        (e0, e1), (a0, a1), (b0, b1) = box.ranges
        g0, g1 = a0 // _GROUP, -(-a1 // _GROUP)
        groups = Box._trusted(((e0, e1), (b0, b1), (g0, g1)))
        blocks = stored(name + _BLOCKS, Box._trusted((*groups.ranges, (0, 16))))
        values = dequantize_mxfp4(blocks, stored(name + _SCALES, groups), dtype=self.dtype)
        return values[:, :, a0 - g0 * _GROUP : a1 - g0 * _GROUP].transpose(1, 2)


def mxfp4_weights(
    config: Mapping[str, object],
    names: tuple[str, ...],
    shape: Callable[[str], tuple[int, ...]],
    dtype: Callable[[str], str],
) -> Mxfp4Weights | None:
    """The MXFP4 weights of a checkpoint of ``config`` holding ``names``; None unless its
    ``quantization_config`` says ``mxfp4``. ``ConversionError`` for blocks without scales
    (or the reverse) or shapes and dtypes that do not pair."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "mxfp4":
        return None
    have = set(names)
    weights, problems = [], []
    for n in names:
        if not n.endswith((_BLOCKS, _SCALES)):
            continue
        base = n.removesuffix(_BLOCKS).removesuffix(_SCALES)
        pair = (base + _BLOCKS, base + _SCALES)
        if not all(p in have for p in pair):
            problems.append(f"{n} without {pair[1] if n == pair[0] else pair[0]}")
            continue
        if n != pair[0]:
            continue
        b, s = shape(pair[0]), shape(pair[1])
        if (
            len(b) != 4
            or b[-1] != 16
            or s != b[:-1]
            or {stored_code(dtype(p)) for p in pair} != {"U8"}
        ):
            problems.append(
                f"{pair[0]} {b} {dtype(pair[0])} and {pair[1]} {s} {dtype(pair[1])}: blocks are "
                "uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]"
            )
            continue
        weights.append(base)
    if problems:
        raise ConversionError(
            f"the checkpoint does not hold what its quantization_config (mxfp4) says: "
            f"{listing(problems)}; download or save it again"
        )
    target = torch_dtype(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
    return Mxfp4Weights(dtype=target, weights=tuple(weights))
