"""What a config's ``quantization_config`` says of its published checkpoint's weights.

DeepSeek-V3, Kimi-K2 (fp8 e4m3, one scale per 128x128 block) and gpt-oss (mxfp4
experts) publish checkpoints whose weights are stored quantised. The spec describes
the model as transformers builds it and the engines train it, in ``torch_dtype``
(bf16), and every size derived from it is a size in that dtype:
:func:`checkpoint_quantization` is the sentence that says so where sizes are shown.
"""

from collections.abc import Mapping

from areal_fn.typecheck import beartype

__all__ = ["checkpoint_quantization"]


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
