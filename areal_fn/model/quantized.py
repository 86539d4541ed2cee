"""What a config's ``quantization_config`` says of its published checkpoint's weights.

DeepSeek-V3, Kimi-K2 (fp8 e4m3, one scale per 128x128 block) and gpt-oss (mxfp4
experts) publish checkpoints whose weights are stored quantised. The spec describes
the model as transformers builds it and the engines train it, in ``torch_dtype``
(bf16), and every size derived from it is a size in that dtype:
:func:`checkpoint_quantization` is the sentence that says so where sizes are shown.

Block FP8: :func:`fp8_format` reads a config's ``quantization_config`` into an
:class:`Fp8Format` (``None`` for none or another method), and :func:`is_fp8_quantized`
is the one rule of which canonical tensors such a checkpoint stores quantised (what
transformers' FP8 quantizer converts); the readers and writers of
:mod:`areal_fn.runtime.hf` and :mod:`areal_fn.plans.fp8` use both.
"""

import re
from collections.abc import Mapping

import attrs

from areal_fn.errors import SpecError
from areal_fn.typecheck import beartype

__all__ = [
    "SCALE_SUFFIX",
    "Fp8Format",
    "checkpoint_quantization",
    "fp8_format",
    "is_fp8_quantized",
    "scale_name",
]


def _blocks(q: Mapping[str, object]) -> str:
    block = q.get("weight_block_size")
    if isinstance(block, list | tuple) and block and all(isinstance(b, int) for b in block):
        return f", one scale per {'x'.join(str(b) for b in block)} block"
    return ""


@beartype
def checkpoint_quantization(config: Mapping[str, object]) -> str | None:
    """How the config's published checkpoint stores its weights (``fp8 e4m3, one scale
    per 128x128 block``), None when its ``quantization_config`` says nothing of it."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping) or not isinstance(q.get("quant_method"), str):
        return None
    method = str(q["quant_method"])
    fmt = q.get("fmt")
    text = method + (f" {fmt}" if isinstance(fmt, str) else "") + _blocks(q)
    kept = q.get("modules_to_not_convert")
    if isinstance(kept, list | tuple) and kept and all(isinstance(k, str) for k in kept):
        text += " except " + ", ".join(str(k) for k in kept)
    return text


# -- block-quantised FP8 (DeepSeek-V3, Kimi-K2, Qwen3-*-FP8) ----------------------------

#: What a quantised ``x.weight``'s scale is called (``x.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"
#: The block transformers' ``FineGrainedFP8Config`` assumes when a config names none.
DEFAULT_BLOCK = (128, 128)
#: Modules of a decoder layer that hold a 2-d ``weight`` but are no Linear transformers
#: converts: the routers (``TopkRouter``), embeddings and output heads (MTP layers').
_NOT_LINEAR = frozenset({"gate", "router", "embed_tokens", "head"})


def _block(value: object) -> tuple[int, int]:
    value = tuple(value) if isinstance(value, list | tuple) else value
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)
    ):
        raise SpecError(
            f"weight_block_size={list(value) if isinstance(value, tuple) else value!r} must "
            "be two positive ints (rows, columns), e.g. [128, 128]"
        )
    return (int(value[0]), int(value[1]))


@attrs.frozen(kw_only=True)
class Fp8Format:
    """Block-quantised FP8 weights: ``float8_e4m3fn`` values, one float32
    ``weight_scale_inv`` per ``block`` (rows x columns; edge blocks are cut), the
    weight being ``value * scale``; ``keep``: the config's ``modules_to_not_convert``."""

    block: tuple[int, int] = attrs.field(default=DEFAULT_BLOCK, converter=_block)
    keep: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def quantization_config(self) -> dict[str, object]:
        """The ``quantization_config`` of a ``config.json`` that says so."""
        out: dict[str, object] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(self.block),
        }
        if self.keep:
            out["modules_to_not_convert"] = list(self.keep)
        return out


def _refuse(what: str, value: object, rule: str) -> SpecError:
    return SpecError(
        f"quantization_config.{what}={value!r}: {rule}; only block-quantised FP8 weights "
        "(quant_method fp8, fmt e4m3, activation_scheme dynamic, float32 weight_scale_inv) "
        "are read: dequantise this checkpoint to the dtype of its config.json first"
    )


@beartype
def fp8_format(config: Mapping[str, object]) -> Fp8Format | None:
    """The block FP8 format a config's ``quantization_config`` says its checkpoint stores
    (``quant_method: fp8``); None without one or for another method (MXFP4, ...).

    ``SpecError`` for an fp8 config this reader cannot read: a format other than e4m3,
    static activation scales, a block that is not two positive ints. A config without
    ``weight_block_size`` has transformers' default, 128x128.
    """
    q = config.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", q.get("fmt"), "FP8 values are read as float8_e4m3fn only")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(
            "activation_scheme", q.get("activation_scheme"), "static activation scales are not read"
        )
    if q.get("scale_fmt", "float") != "float":
        raise _refuse("scale_fmt", q.get("scale_fmt"), "scales are read as float32 only")
    block = q.get("weight_block_size", list(DEFAULT_BLOCK))
    if not isinstance(block, list | tuple):
        raise _refuse("weight_block_size", block, "per-tensor scales are not read")
    keep = q.get("modules_to_not_convert") or ()
    if not isinstance(keep, list | tuple) or not all(isinstance(k, str) for k in keep):
        raise _refuse("modules_to_not_convert", keep, "it must be a list of module names")
    return Fp8Format(block=_block(block), keep=tuple(keep))


def _kept(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``module`` is named by one of ``patterns`` (``modules_to_not_convert``):
    a pattern matches from the start as a regular expression up to a module boundary
    (``model.layers.*.self_attn``), or is a suffix of the name (``lm_head``)."""
    for p in patterns:
        if module.endswith(p):
            return True
        try:
            if re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module):
                return True
        except re.error:
            continue
    return False


@beartype
def is_fp8_quantized(name: str, shape: tuple[int, ...], fmt: Fp8Format) -> bool:
    """Whether canonical tensor ``name`` is stored quantised in an FP8 checkpoint of
    ``fmt``: the weight of a Linear of a decoder layer (attention projections, MLP,
    routed and shared experts), not an embedding, output head, norm, bias or router
    gate, nor a module ``fmt.keep`` names. The one rule readers and writers use."""
    if len(shape) != 2 or not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    if module.rsplit(".", 1)[-1] in _NOT_LINEAR or "norm" in module.rsplit(".", 1)[-1]:
        return False
    return not _kept(module, fmt.keep)


def scale_name(name: str) -> str:
    """The scale tensor beside quantised ``name`` (``x.weight`` -> ``x.weight_scale_inv``)."""
    return name + SCALE_SUFFIX
