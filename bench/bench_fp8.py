"""Block FP8 dequantise / quantise speed against a plain copy of the same bytes.

One DeepSeek-V3-sized expert weight (``[ROWS, COLS]`` bf16, 128x128 blocks), in one
process, best of ``ROUNDS`` rounds, each side taking turns in every round:

- ``dequantise``: :func:`~areal_fn.plans.fp8.dequantize_fp8` of the FP8 values and
  scales into a new bf16 tensor, against ``copy``: a new bf16 tensor copied from a bf16
  one (the same output bytes), and against transformers' ``Fp8Dequantize`` op (what
  ``from_pretrained(..., FineGrainedFP8Config(dequantize=True))`` runs per weight);
  the three checked bitwise equal first;
- ``quantise``: :func:`~areal_fn.plans.fp8.block_amax` then
  :func:`~areal_fn.plans.fp8.quantize_fp8` (values and scales), against ``copy`` (a new
  bf16 tensor of the input) and transformers' ``Fp8Quantize`` op;
- ``read``: ``HfCheckpoint.read`` of a TP-half box (rows ``[0, ROWS/2)``) from an FP8
  checkpoint (values memory-mapped, dequantised) against the same box of the bf16
  checkpoint of the same weights, copied out of its memory map (page cache warm).

Ratios are copy time / ours (1.0x: as fast as copying the bytes). Run:
``python -m bench fp8``.
"""

import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from areal_fn.model.quantized import Fp8Format
from areal_fn.plans.fp8 import block_amax, dequantize_fp8, quantize_fp8
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from areal_fn.sharding.box import Box

ROWS, COLS = 7168, 2048  # one DeepSeek-V3 expert's down_proj (hidden x moe_intermediate)
BLOCK = (128, 128)
ROUNDS = 5
NAME = "model.layers.3.mlp.experts.0.down_proj.weight"


def _best(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best seconds of each over ``ROUNDS`` rounds, taking turns in every round."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            gc.collect()
            start = time.perf_counter()
            out = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            del out
    return best


def _print(title: str, nbytes: int, times: dict[str, float]) -> None:
    copy = times["copy"]
    print(f"{title} ({nbytes / 2**20:.0f} MiB of bf16 out/in):")
    for name, t in times.items():
        print(
            f"  {name:<28} {t * 1e3:8.1f} ms  {nbytes / t / 2**30:6.2f} GiB/s  {copy / t:5.2f}x copy"
        )


def _transformers_ops() -> tuple[object, object]:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    q = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=BLOCK))
    return Fp8Dequantize(q), Fp8Quantize(q)


def _in_memory(x: torch.Tensor) -> None:
    deq, quant = _transformers_ops()
    q, s = quantize_fp8(x, block_amax(x, block=BLOCK), block=BLOCK)
    ours = dequantize_fp8(q, s, block=BLOCK, dtype=torch.bfloat16)
    theirs = deq._dequantize_one(q, s, output_dtype=torch.bfloat16)  # type: ignore[attr-defined]
    assert torch.equal(ours, theirs)
    plain = ours.clone()
    nbytes = x.numel() * 2
    _print(
        "dequantise",
        nbytes,
        _best(
            {
                "copy": lambda: torch.empty_like(plain).copy_(plain),
                "ours (dequantize_fp8)": lambda: dequantize_fp8(
                    q, s, block=BLOCK, dtype=torch.bfloat16
                ),
                "transformers Fp8Dequantize": lambda: deq._dequantize_one(  # type: ignore[attr-defined]
                    q, s, output_dtype=torch.bfloat16
                ),
            }
        ),
    )
    _print(
        "quantise",
        nbytes,
        _best(
            {
                "copy": lambda: torch.empty_like(x).copy_(x),
                "ours (block_amax+quantize)": lambda: quantize_fp8(
                    x, block_amax(x, block=BLOCK), block=BLOCK
                ),
                "transformers Fp8Quantize": lambda: quant._quantize_one(NAME, x),  # type: ignore[attr-defined]
            }
        ),
    )


def _from_files(x: torch.Tensor, tmp: Path) -> None:
    config = {"model_type": "deepseek_v3", "torch_dtype": "bfloat16"}
    write_hf_checkpoint(tmp / "bf16", {NAME: x}, config=config)
    write_hf_checkpoint(tmp / "fp8", {NAME: x}, config=config, fp8=Fp8Format(block=BLOCK))
    box = Box(ranges=((0, ROWS // 2), (0, COLS)))
    with HfCheckpoint(tmp / "bf16") as plain, HfCheckpoint(tmp / "fp8") as fp8:
        assert fp8.dtype(NAME) == "bfloat16" and fp8.quantized is not None
        _print(
            "read a TP-half box",
            box.numel * 2,
            _best(
                {
                    "copy": lambda: plain.read(NAME, box).clone(),
                    "ours (FP8 file)": lambda: fp8.read(NAME, box),
                }
            ),
        )


def run() -> None:
    torch.manual_seed(0)
    x = (torch.randn(ROWS, COLS) * 0.02).to(torch.bfloat16)
    print(
        f"[{ROWS}, {COLS}] bf16, {BLOCK[0]}x{BLOCK[1]} blocks, best of {ROUNDS}, "
        f"{torch.get_num_threads()} torch threads"
    )
    _in_memory(x)
    with tempfile.TemporaryDirectory() as tmp:
        _from_files(x, Path(tmp))


if __name__ == "__main__":
    run()
