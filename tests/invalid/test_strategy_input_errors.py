"""Strategies and model names that cannot be read one way: one line, with the remedy.

Each row is (call, error type, message regex); every message is a single line.
"""

from pathlib import Path

import pytest

from areal_fn import (
    ParallelDims,
    check_strategy,
    estimate_memory,
    fsdp2_layout,
    inference_layout,
    megatron_layout,
    model_from_hf_config,
    parse_allocation,
)
from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import Fsdp2Options
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.plans.memory.activations import ActivationModel

MODEL = model_from_hf_config(DEMO_CONFIG)
FSDP4 = parse_allocation("fsdp:d4").training
ACT = ActivationModel(micro_batch_size=1, seq_len=16)


def _empty_dir() -> object:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return model_from_hf_config(Path(d))


CASES = [
    (
        lambda: fsdp2_layout(MODEL, "sglang:d4t2+fsdp:d8"),
        LayoutError,
        r"^fsdp2_layout: 'sglang:d4t2\+fsdp:d8' has 2 components \('sglang:d4t2', 'fsdp:d8'\) and "
        r"fsdp2_layout lays out one; pass one of them, e.g. fsdp2_layout\(model, 'fsdp:d8'\), or "
        r"parse_allocation\(...\).component\(name\)$",
    ),
    (
        lambda: megatron_layout(MODEL, parse_allocation("sglang[r]:d2+megatron[a]:t2")),
        LayoutError,
        r"^megatron_layout: 'sglang\[r\]:d2\+megatron\[a\]:d1t2' has 2 components",
    ),
    (
        lambda: fsdp2_layout(MODEL, "sglang:d2t2"),
        LayoutError,
        r"^fsdp2_layout: 'sglang:d2t2' is a sglang component but fsdp2_layout lays out fsdp; pass "
        r"a fsdp component, or use layout_for\(model, component\), which picks the layout of its "
        r"backend$",
    ),
    (
        lambda: megatron_layout(MODEL, FSDP4),
        LayoutError,
        r"^megatron_layout: 'fsdp:d4' is a fsdp component but megatron_layout lays out megatron",
    ),
    (
        lambda: inference_layout(MODEL, "megatron:t2"),
        LayoutError,
        r"^inference_layout: 'megatron:t2' is a megatron component but inference_layout lays out "
        r"sglang or vllm",
    ),
    (
        lambda: layout_for(MODEL, "sglang:d2+fsdp:d2"),
        LayoutError,
        r"^layout_for: 'sglang:d2\+fsdp:d2' has 2 components",
    ),
    (
        lambda: estimate_memory(
            fsdp2_layout(MODEL, "fsdp:d2"), activation=ACT, model=MODEL, dims="sglang:d2+fsdp:d2"
        ),
        LayoutError,
        r"^estimate_memory: 'sglang:d2\+fsdp:d2' has 2 components",
    ),
    (
        lambda: check_strategy(MODEL, ParallelDims(dp=4, tp=2)),
        LayoutError,
        r"^check_strategy: ParallelDims\(dp=4, tp=2\) names no backend, so which rules apply is "
        r"not known; pass an allocation string such as 'fsdp:d4t2', or "
        r"Component\(backend=..., dims=...\)$",
    ),
    # -- HSDP given twice, or where it does not apply
    (
        lambda: fsdp2_layout(MODEL, "fsdp:d2x4", options=Fsdp2Options(hsdp_replicas=4)),
        LayoutError,
        r"^dims.dp_replicate=2 and hsdp_replicas=4 both give the HSDP replicas and differ; give "
        r"them once \(leave hsdp_replicas=1\)$",
    ),
    (
        lambda: megatron_layout(MODEL, ParallelDims(dp=4, dp_replicate=2)),
        LayoutError,
        r"^dp_replicate=2: HSDP replicas \(fsdp:d2x4\) are an FSDP2 layout's; a Megatron layout "
        r"takes dp as one number; use dp_replicate=1$",
    ),
    (
        lambda: inference_layout(MODEL, ParallelDims(dp=2, dp_replicate=2)),
        LayoutError,
        r"^dp_replicate=2: HSDP replicas \(fsdp:d2x4\) are an FSDP2 layout's; an inference layout",
    ),
    # -- model names
    (
        lambda: model_from_hf_config("Qwen2.5-7B-Instruct"),
        SpecError,
        r"^no config file at 'Qwen2.5-7B-Instruct' and no embedded model of that name; did you "
        r"mean 'Qwen2.5-7B' or 'Qwen2.5-72B' or 'Qwen3-Next-80B-A3B-Instruct'\? pass a "
        r"config.json, a directory holding one, or a "
        r"name that `areal-fn models` lists$",
    ),
    (
        lambda: model_from_hf_config("gpt2"),
        SpecError,
        r"^no config file at 'gpt2' and no embedded model of that name; pass a config.json, a "
        r"directory holding one, or a name that `areal-fn models` lists \(demo, .*Qwen2.5-7B, .*\)$",
    ),
    (
        _empty_dir,
        SpecError,
        r"^no config file at '.*/config.json'; pass a config.json path, a directory holding "
        r"config.json, or the config as a dict$",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), CASES, ids=[c[2][:50] for c in CASES])
def test_error_message(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message) as info:
        call()
    assert "\n" not in str(info.value)
