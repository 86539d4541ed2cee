"""Code that places plain canonical boxes refuses layouts with strided pieces, by name.

gpt-oss experts under Megatron (``linear_fc1`` = ``gate_up_proj`` de-interleaved and
transposed) are strided pieces: conversion handles them, and so does weight-sync
planning, in the lifted basis (``tests/laws/test_strided_transfer.py``); checkpoint
plans too; a stored chunk that splits a (gate, up) pair cannot be read into such a
layout and is refused with the chunk and a remedy.
"""

import attrs
import pytest

from areal_fn import ParallelDims, fsdp2_layout, inference_layout, megatron_layout
from areal_fn.errors import CheckpointError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.checkpoint.manifest import Chunk
from areal_fn.plans.checkpoint.read import plan_load
from areal_fn.plans.checkpoint.write import plan_save
from areal_fn.sharding.box import Box
from tests.laws.test_strided_pieces import TINY_GPT_OSS
from tests.manifest_util import weights_manifest

MODEL = model_from_hf_config(TINY_GPT_OSS)
# 2 layers x 2 experts x fc1/fc2 weight and bias: 16 strided or transposed tensors
STRIDED = megatron_layout(MODEL, ParallelDims(tp=2))


def test_the_layouts_say_which_are_strided():
    assert STRIDED.is_strided
    assert not fsdp2_layout(MODEL, ParallelDims(dp=2)).is_strided
    assert not inference_layout(MODEL, ParallelDims(tp=2)).is_strided


def test_a_stored_chunk_that_cuts_inside_units_is_refused():
    """A checkpoint chunk of ``gate_up_proj`` that ends at an odd column splits a (gate,
    up) pair: the strided layout cannot read it through its lifted views."""
    plain = fsdp2_layout(MODEL, ParallelDims(dp=2))
    manifest = weights_manifest(plan_save(plain), MODEL, allocation="fsdp:d2")
    plan_load(manifest, STRIDED, 0)  # FSDP2's chunks (whole experts) are whole units
    name = "model.layers.0.mlp.experts.gate_up_proj"
    e, h, n = next(t.shape for t in manifest.tensors if t.name == name)
    odd = (
        Chunk(box=Box(ranges=((0, e), (0, h), (0, 3))), rank=0),
        Chunk(box=Box(ranges=((0, e), (0, h), (3, n))), rank=1),
    )
    cut = attrs.evolve(
        manifest,
        tensors=tuple(
            attrs.evolve(t, chunks=odd) if t.name == name else t for t in manifest.tensors
        ),
    )
    with pytest.raises(
        CheckpointError,
        match=rf"{name}: stored chunk \[0:{e}, 0:{h}, 0:3\] cuts inside the units of steps "
        r"\(1, 1, 2\) that this layout's strided pieces take; load it into a layout without "
        r"strided pieces \(FSDP2\), or read the canonical tensors and convert them",
    ):
        plan_load(cut, STRIDED, 0)
    plan_load(cut, plain, 0)  # a plain layout reads any tiling
