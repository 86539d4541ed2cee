"""Code that places plain canonical boxes refuses layouts with strided pieces, by name.

gpt-oss experts under Megatron (``linear_fc1`` = ``gate_up_proj`` de-interleaved and
transposed) are strided pieces: conversion handles them, and so does weight-sync
planning, in the lifted basis (``tests/laws/test_strided_transfer.py``); checkpoint
plans too, a stored chunk that splits a (gate, up) pair included
(``tests/laws/test_strided_checkpoint_parts.py``).
"""

from areal_fn import ParallelDims, fsdp2_layout, inference_layout, megatron_layout
from areal_fn.model.spec import model_from_hf_config
from tests.laws.test_strided_pieces import TINY_GPT_OSS

MODEL = model_from_hf_config(TINY_GPT_OSS)
# 2 layers x 2 experts x fc1/fc2 weight and bias: 16 strided or transposed tensors
STRIDED = megatron_layout(MODEL, ParallelDims(tp=2))


def test_the_layouts_say_which_are_strided():
    assert STRIDED.is_strided
    assert not fsdp2_layout(MODEL, ParallelDims(dp=2)).is_strided
    assert not inference_layout(MODEL, ParallelDims(tp=2)).is_strided
