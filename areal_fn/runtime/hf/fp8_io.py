"""Block-quantised FP8 HF checkpoints: read as the model's dtype, written from it.

Reading: a checkpoint whose ``config.json`` has ``quantization_config`` ``quant_method:
fp8`` (:func:`~areal_fn.model.quantized.fp8_format`) holds, beside each quantised
``x.weight`` (``float8_e4m3fn``), its ``x.weight_scale_inv`` (float32, one per block).
:class:`Fp8Weights` says which tensors those are; the readers
(:class:`~areal_fn.runtime.hf.io.HfCheckpoint`, :func:`~areal_fn.runtime.hf.load_into.load_into`)
then show each such weight under its own name, shape and the config's ``torch_dtype``,
and dequantise only the box read (:func:`~areal_fn.plans.fp8.dequantize_fp8`), one
tensor at a time. The scales are not shown as tensors of their own.
:func:`quantized_weights` is what the readers call: this, or gpt-oss's MXFP4 experts
(:mod:`~areal_fn.runtime.hf.mxfp4_io`), through the one :class:`Quantized` interface.

Writing: :func:`quantized_stream` turns a stream of canonical tensors into the stored
ones (each weight :func:`~areal_fn.model.quantized.is_fp8_quantized` names as its FP8
values and scales, the rest unchanged) and :func:`fp8_config` the ``config.json`` that
says so.
"""

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import attrs
import torch

from areal_fn.errors import ConversionError
from areal_fn.model.quantized import Fp8Format, fp8_format, is_fp8_quantized, scale_name
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.fp8 import block_amax, dequantize_fp8, quantize_fp8, scale_grid
from areal_fn.plans.tensor_check import listing
from areal_fn.runtime.hf.mxfp4_io import mxfp4_weights, stored_code
from areal_fn.sharding.box import Box

__all__ = [
    "READ_METHODS",
    "Fp8Weights",
    "Quantized",
    "fp8_config",
    "fp8_weights",
    "noting_quantised",
    "quantized_stream",
    "quantized_weights",
    "written_quantization",
]

#: ``stored(name, box)``: ``box`` of a tensor as the checkpoint stores it.
Stored = Callable[[str, Box], torch.Tensor]


class Quantized(Protocol):
    """What the readers ask of a checkpoint's quantised weights."""

    @property
    def names(self) -> frozenset[str]:
        """The weights shown (in the model's ``dtype``)."""

    @property
    def hidden(self) -> frozenset[str]:
        """The stored tensors not shown (scales, blocks)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def shape(self, name: str, stored: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]: ...

    def read(self, name: str, box: Box, stored: Stored) -> torch.Tensor: ...


_FP8, _F32 = "F8_E4M3", "F32"


@attrs.frozen(kw_only=True)
class Fp8Weights:
    """The quantised weights of a checkpoint: ``scales`` maps each to its scale tensor."""

    fmt: Fp8Format
    dtype: torch.dtype
    scales: tuple[tuple[str, str], ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(w for w, _ in self.scales)

    @property
    def hidden(self) -> frozenset[str]:
        """The scale tensors, which readers do not show."""
        return frozenset(s for _, s in self.scales)

    def shape(self, name: str, stored: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        """Weight ``name``'s shape (``stored``: a stored tensor's shape)."""
        return stored(name)

    def read(self, name: str, box: Box, stored: Stored) -> torch.Tensor:
        """``box`` of weight ``name`` dequantised from its FP8 values in the box and the
        scales of the blocks the box touches (``stored(name, box)`` reads them)."""
        (r0, r1), (c0, c1) = box.ranges
        bm, bn = self.fmt.block
        grid = Box._trusted(((r0 // bm, -(-r1 // bm)), (c0 // bn, -(-c1 // bn))))
        return dequantize_fp8(
            stored(name, box),
            stored(scale_name(name), grid),
            block=self.fmt.block,
            dtype=self.dtype,
            origin=(r0, c0),
        )


def quantized_weights(
    path: Path,
    names: "tuple[str, ...]",
    shape: Callable[[str], tuple[int, ...]],
    dtype: Callable[[str], str],
) -> Quantized | None:
    """The quantised weights of the checkpoint in ``path`` as its ``config.json`` declares
    them: block FP8 (:func:`fp8_weights`), MXFP4
    (:func:`~areal_fn.runtime.hf.mxfp4_io.mxfp4_weights`), None for neither."""
    config = _config(path)
    if config is None:
        return None
    found = fp8_weights(path, names, shape, dtype)
    return found if found is not None else mxfp4_weights(config, names, shape, dtype)


def _config(path: Path) -> Mapping[str, object] | None:
    f = path / "config.json"
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise ConversionError(f"{f} is not JSON ({e})") from None
    return data if isinstance(data, dict) else None


def fp8_weights(
    path: Path,
    names: "tuple[str, ...]",
    shape: Callable[[str], tuple[int, ...]],
    dtype: Callable[[str], str],
) -> Fp8Weights | None:
    """The FP8 weights of the checkpoint in ``path`` (``names``: its stored tensors,
    ``shape``/``dtype``: theirs, asked only of an FP8 checkpoint), None when its
    ``config.json`` says nothing of FP8.

    ``ConversionError`` when a scale belongs to no FP8 weight or has the wrong shape, or
    an FP8 weight has no scale: the file does not match its ``quantization_config``.
    """
    config = _config(path)
    fmt = fp8_format(config) if config is not None else None
    if fmt is None:
        return None
    assert config is not None
    target = torch_dtype(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
    shapes = {n: shape(n) for n in names}
    dtypes = {n: dtype(n) for n in names}
    pairs, problems = [], []
    for name, dims in shapes.items():
        s = scale_name(name)
        quantised = stored_code(dtypes[name]) == _FP8
        if s not in shapes:
            if quantised:
                problems.append(f"{name} is FP8 without {s}")
            continue
        want = scale_grid((dims[0], dims[1]), fmt.block) if len(dims) == 2 else None
        if not quantised or want != shapes[s] or stored_code(dtypes[s]) != _F32:
            problems.append(
                f"{name} ({dtypes[name]}, {dims}) and {s} ({dtypes[s]}, {shapes[s]}): an FP8 "
                f"weight's float32 scales of {fmt.block[0]}x{fmt.block[1]} blocks are {want}"
            )
            continue
        pairs.append((name, s))
    orphans = [
        n for n in shapes if n.endswith("_scale_inv") and n.removesuffix("_scale_inv") not in shapes
    ]
    if orphans:
        problems.append(f"scales of no tensor {listing(orphans)}")
    if problems:
        raise ConversionError(
            f"{path} does not hold what its quantization_config says (block FP8 weights, "
            f"{fmt.block[0]}x{fmt.block[1]} blocks): {'; '.join(problems[:6])}; download or "
            "save it again, or fix weight_block_size"
        )
    return Fp8Weights(fmt=fmt, dtype=target, scales=tuple(sorted(pairs)))


#: The ``quant_method`` values the readers read (and a writer replaces or drops).
READ_METHODS = ("fp8", "mxfp4")


def fp8_config(config: Mapping[str, object], fmt: Fp8Format | None) -> dict[str, object]:
    """``config`` with the ``quantization_config`` of ``fmt``, or (None) without an FP8
    or MXFP4 one, the weights being written in their own dtype. ``ConversionError`` for
    a config quantised by a method the readers do not read."""
    out = dict(config)
    q = out.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if q is not None and method not in READ_METHODS:
        raise ConversionError(
            f"config.json's quantization_config says quant_method={method!r}, which this "
            "writer does not write: drop it from config.json (the weights written are "
            "unquantised" + (" or FP8" if fmt is not None else "") + ")"
        )
    out.pop("quantization_config", None)
    if fmt is not None:
        out["quantization_config"] = fmt.quantization_config()
    return out


def quantized_stream(
    items: Iterator[tuple[str, torch.Tensor]], fmt: Fp8Format, scales: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` as an FP8 checkpoint stores them: every weight the rule quantises
    followed by its scale (whose name is added to ``scales``), the rest as given."""
    for name, t in items:
        if t.ndim == 3 and ".experts." in name:
            raise ConversionError(
                f"{name} holds stacked experts {tuple(t.shape)} (gpt-oss), which FP8 "
                "checkpoints store per expert; write this model without fp8"
            )
        if not is_fp8_quantized(name, tuple(t.shape), fmt):
            yield name, t
            continue
        q, s = quantize_fp8(t, block_amax(t, block=fmt.block), block=fmt.block, name=name)
        scales.add(scale_name(name))
        yield name, q
        yield scale_name(name), s


def noting_quantised(
    items: Iterator[tuple[str, torch.Tensor]], written: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` unchanged; ``fp8`` added to ``written`` when one is stored as FP8,
    ``mxfp4`` when one is MXFP4 blocks (uint8 ``*_blocks``)."""
    for name, t in items:
        if t.dtype == torch.float8_e4m3fn:
            written.add("fp8")
        elif t.dtype == torch.uint8 and name.endswith("_blocks"):
            written.add("mxfp4")
        yield name, t


def written_quantization(
    config: Mapping[str, object] | bytes | None,
    model: ModelSpec | None,
    fp8: "Fp8Format | None",
    *,
    written: set[str],
) -> Mapping[str, object] | bytes | None:
    """The ``config.json`` to write: with ``fp8``'s ``quantization_config`` when FP8
    tensors were ``written``; without an FP8 or MXFP4 one when none of its tensors were;
    else ``config`` as given."""
    cfg = config if config is not None else (model.hf_config() if model is not None else None)
    if cfg is None:
        return None
    parsed = json.loads(cfg) if isinstance(cfg, bytes) else cfg
    q = parsed.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if fp8 is not None:
        return fp8_config(parsed, fp8 if "fp8" in written else None)
    if method in READ_METHODS and method not in written:
        return fp8_config(parsed, None)
    return config
