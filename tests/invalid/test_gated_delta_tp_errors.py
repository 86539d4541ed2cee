"""Tensor parallelism over a gated delta net: what is refused, each message pinned.

Each ``tp`` rank runs whole key-head groups, so ``tp`` must divide
``linear_num_key_heads``: the FSDP2 layout (the engine), the inference layouts and
:mod:`areal_fn.model.linear_tp` refuse other values, saying which work.
"""

import re

import pytest

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.model.linear_tp import delta_local_heads, delta_qkv_rows
from areal_fn.model.spec import model_from_hf_config
from tests.distributed import gated_delta_configs

#: three key heads (six value heads): tp=2 divides the attention heads, not these
THREE = {"linear_num_key_heads": 3, "linear_num_value_heads": 6}


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("build", [fsdp2_layout, inference_layout])
def test_tp_must_divide_the_key_heads(name: str, build: object) -> None:
    spec = model_from_hf_config({**getattr(gated_delta_configs, name)(), **THREE})
    dims = "fsdp:d2t2" if build is fsdp2_layout else "vllm:t2"
    with pytest.raises(
        LayoutError,
        match=re.escape(
            f"tp=2 does not divide linear_num_key_heads=3 ({name}); each tp rank runs whole "
            "key-head groups of the linear-attention layers, as Megatron-Core and vLLM split "
            "them; use tp in {1}"
        ),
    ):
        build(spec, dims)  # type: ignore[operator]


def test_the_pure_split_refuses_too() -> None:
    la = model_from_hf_config({**gated_delta_configs.qwen3_5_text(), **THREE}).linear_attention
    assert la is not None
    with pytest.raises(
        LayoutError,
        match=re.escape(
            "tp=2 does not divide linear_num_key_heads=3; each tp rank runs whole key-head "
            "groups of the linear-attention layers, use tp in [1, 3]"
        ),
    ):
        delta_local_heads(la, 2)
    with pytest.raises(
        LayoutError, match=re.escape("rank=3 is not a rank of tp=3; use 0 <= rank < tp")
    ):
        delta_qkv_rows(la, 3, 3)
