"""Code that places plain canonical boxes refuses layouts with strided pieces, by name.

gpt-oss experts under Megatron (``linear_fc1`` = ``gate_up_proj`` de-interleaved and
transposed) are strided pieces: conversion handles them, and so does weight-sync
planning, in the lifted basis (``tests/laws/test_strided_transfer.py``); checkpoint
plans refuse such a layout with the tensors and a remedy, before any work.
"""

import pytest

from areal_fn import ParallelDims, fsdp2_layout, inference_layout, megatron_layout
from areal_fn.errors import CheckpointError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.checkpoint_manifest import make_manifest, optimizer_spec
from areal_fn.plans.checkpoint_read import plan_load
from areal_fn.plans.checkpoint_write import plan_save
from tests.laws.test_strided_pieces import TINY_GPT_OSS

MODEL = model_from_hf_config(TINY_GPT_OSS)
# 2 layers x 2 experts x fc1/fc2 weight and bias: 16 strided or transposed tensors
STRIDED = megatron_layout(MODEL, ParallelDims(tp=2))
NAMES = r"holds 16 tensor\(s\) made of them \(\['decoder\.layers\.0\.mlp\.experts"


def test_the_layouts_say_which_are_strided():
    assert STRIDED.is_strided
    assert not fsdp2_layout(MODEL, ParallelDims(dp=2)).is_strided
    assert not inference_layout(MODEL, ParallelDims(tp=2)).is_strided


def test_checkpoint_plans_refuse_them():
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint planning does not handle strided or transposed pieces yet; this "
        r"megatron layout " + NAMES + r".*save from a layout without them \(FSDP2\)",
    ):
        plan_save(STRIDED)
    plain = fsdp2_layout(MODEL, ParallelDims(dp=2))
    manifest = make_manifest(
        plan_save(plain),
        allocation="fsdp:d2",
        model_config=MODEL.hf_config(),
        step=1,
        optimizer=optimizer_spec("none"),
        dtypes={c.name: c.dtype for c in MODEL.tensors},
        library_version="0.1.0",
    )
    with pytest.raises(CheckpointError, match=r"load into a layout without them \(FSDP2\)"):
        plan_load(manifest, STRIDED, 0)
