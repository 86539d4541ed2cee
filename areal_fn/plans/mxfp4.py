"""MXFP4 (gpt-oss's published experts): the values of stored blocks and scales.

A weight stored as MXFP4 is two tensors: ``X_blocks`` (uint8 ``[..., G, 16]``: 32 FP4
e2m1 values per group, two per byte, the low nibble first) and ``X_scales`` (uint8
``[..., G]``: one E8M0 exponent per group, the scale being ``2**(s - 127)``).
:func:`dequantize_mxfp4` gives the ``[..., G * 32]`` values, each exact in float32
(an e2m1 value times a power of two), cast to ``dtype``.
"""

import torch
from torch import Tensor

from areal_fn.errors import ConversionError
from areal_fn.typecheck import beartype

__all__ = ["FP4_E2M1", "dequantize_mxfp4"]

#: The 16 e2m1 values by code (sign bit 3, two exponent bits, one mantissa bit).
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _powers_of_two(scales: Tensor) -> Tensor:
    """``2**(s - 127)`` as float32, exactly: ``s`` placed in float32's exponent field
    (``s = 0`` is ``2**-127``, a subnormal; ``s = 255`` is infinity)."""
    bits = scales.to(torch.int32).bitwise_left_shift_(23)
    return torch.where(scales == 0, 2.0**-127, bits.view(torch.float32))


@beartype
def dequantize_mxfp4(blocks: Tensor, scales: Tensor, *, dtype: torch.dtype) -> Tensor:
    """The values of MXFP4 ``blocks`` (uint8 ``[..., G, 16]``) with ``scales`` (uint8
    ``[..., G]``): ``[..., G * 32]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1:] != (16,):
        raise ConversionError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
            f"{tuple(scales.shape)} {scales.dtype}: blocks are uint8 [..., G, 16], scales uint8 "
            "[..., G]"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ConversionError(
            f"MXFP4 blocks {tuple(blocks.shape)} need scales {tuple(blocks.shape[:-1])}, got "
            f"{tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], 16, 2, dtype=torch.float32)
    values[..., 0] = lut[blocks.bitwise_and(0x0F).long()]
    values[..., 1] = lut[blocks.bitwise_right_shift(4).long()]
    values = values.view(*blocks.shape[:-1], 32).mul_(_powers_of_two(scales).unsqueeze(-1))
    return values.view(*blocks.shape[:-2], blocks.shape[-2] * 32).to(dtype)
