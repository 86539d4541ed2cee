"""torchrun worker (2 ranks, gloo, needs torchao): ``Fsdp2Engine`` with
``float8_recipe`` under ``fsdp:d2`` against the same model converted by torchao's
``convert_to_float8_training`` and trained in one process, each data-parallel share's
rows in a forward and backward of their own (FP8 scales are per tensor or per row of
what one forward sees), then ``clip_grad_norm_`` and AdamW. Rank 0 writes
``<out>/float8.json``: per recipe the loss, the gradient norms, the largest weight
difference where the reference gradient is at least 1e-6, and the loss and weight
differences from fp32 training (FP8 must change them). Run by ``test_fp8_training.py``.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.model.spec import model_from_hf_config  # noqa: E402
from areal_fn.runtime.engines.common import split_rows  # noqa: E402
from areal_fn.runtime.engines.fp8_training import convert_to_float8  # noqa: E402
from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine  # noqa: E402
from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions  # noqa: E402
from areal_fn.strategy.parse import parse_allocation  # noqa: E402
from tests.distributed.grad_worker import (  # noqa: E402
    ADAMW,
    CLIP,
    CONDITIONED,
    canonical_of,
    global_batch,
    randomized_model,
)

#: hidden and MLP widths multiples of 16: every linear but lm_head runs in FP8
CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50,
    "torch_dtype": "float32",
}
DP = 2


def reference(recipe: str | None) -> dict[str, Any]:
    spec = model_from_hf_config(CONFIG)
    model = randomized_model(spec, seed=11)
    w0 = canonical_of(model, spec)
    if recipe is not None:
        convert_to_float8(model, recipe)
    ids = global_batch(spec.vocab_size)
    count = ids[:, 1:].numel()
    total = 0.0
    for share in range(DP):
        rows = split_rows(ids, DP, share)
        logits = model(input_ids=rows).logits[:, :-1]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum"
        )
        (loss / count).backward()
        total += float(loss.detach()) / count
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    grads = canonical_of(model, spec, grads=True)
    ADAMW.build(model.parameters()).step()
    return {
        "spec": spec,
        "ids": ids,
        "w0": w0,
        "loss": total,
        "norm": norm,
        "grads": grads,
        "w1": canonical_of(model, spec),
        "converted": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
    }


def engine_step(ref: dict[str, Any], recipe: str | None) -> tuple[dict[str, Any], Any, int]:
    component = parse_allocation(f"fsdp:d{DP}").training
    run = Fsdp2RunOptions(float8_recipe=recipe)
    engine = Fsdp2Engine(ref["spec"], component, run_options=run, optimizer=ADAMW, grad_clip=CLIP)
    engine.load_canonical(ref["w0"])
    stats = engine.train_step(split_rows(ref["ids"], engine.dp_size, engine.dp_rank))
    converted = sum(type(m).__name__ == "Float8Linear" for m in engine.model.modules())
    return stats, engine.export_canonical(), converted


def conditioned_diff(w1: Any, ref: dict[str, Any]) -> float:
    worst = 0.0
    for k, want in ref["w1"].items():
        keep = ref["grads"][k].abs() >= CONDITIONED
        if bool(keep.any()):
            worst = max(worst, float((w1[k] - want).abs()[keep].max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    plain = reference(None)
    out: dict[str, Any] = {}
    for recipe in args.recipes.split(","):
        ref = reference(recipe)
        stats, w1, converted = engine_step(ref, recipe)
        out[recipe] = {
            "converted": [converted, ref["converted"]],
            "loss": [stats["loss"], ref["loss"]],
            "grad_norm": [stats["grad_norm"], ref["norm"]],
            "weights_diff_conditioned": conditioned_diff(w1, ref),
            "loss_vs_fp32": abs(ref["loss"] - plain["loss"]),
            "weights_vs_fp32": max(
                float((ref["w1"][k] - plain["w1"][k]).abs().max()) for k in plain["w1"]
            ),
        }
    if dist.get_rank() == 0:
        Path(args.out, "float8.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
