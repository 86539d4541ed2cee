"""`TensorSpec`: the name, shape and dtype of one tensor (never its data)."""

import re

import attrs
import torch

from areal_fn.errors import SpecError
from areal_fn.typecheck import beartype

#: dtype names accepted in records, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

#: bytes per element of each dtype name.
DTYPE_BYTES: dict[str, int] = {
    name: (1 if dt == torch.bool else torch.empty((), dtype=dt).element_size())
    for name, dt in DTYPES.items()
}


def dtype_name(dtype: "torch.dtype | str") -> str:
    """Name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``); validates strings."""
    if isinstance(dtype, torch.dtype):
        for name, dt in DTYPES.items():
            if dt == dtype:
                return name
        raise SpecError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
    if dtype not in DTYPES:
        raise SpecError(f"dtype={dtype!r} is not a known dtype; use one of {sorted(DTYPES)}")
    return dtype


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name."""
    return DTYPES[dtype_name(name)]


def _shape(value: object) -> tuple[int, ...]:
    if isinstance(value, int) or not hasattr(value, "__iter__"):
        raise SpecError(f"shape={value!r} is not a sequence of ints; pass e.g. (4096, 1024)")
    out = tuple(value)  # type: ignore[arg-type]
    for d in out:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise SpecError(f"shape={out!r} has dim {d!r}; every dim must be an int >= 0")
    return out


def _check_name(_inst: object, _attr: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise SpecError(f"TensorSpec.name={value!r} must be a non-empty string")


@attrs.frozen(kw_only=True)
class TensorSpec:
    """A tensor's identity: canonical (HF checkpoint) name, full shape, dtype name."""

    name: str = attrs.field(validator=_check_name)
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: str = attrs.field(default="bfloat16", converter=dtype_name)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@beartype
def layer_of(name: str) -> int | None:
    """The layer index of a canonical tensor name (a decoder layer's, or past the last one a
    multi-token-prediction layer's), None for non-layer tensors."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None
