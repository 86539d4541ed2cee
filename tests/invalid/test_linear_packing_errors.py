"""Packed rows and split sequences: what is still refused, each message pinned.

The gated-delta-net families pack (``linear_packed`` runs their linear-attention layers
on each sequence alone) but refuse Ulysses / context parallelism; the DSA families
refuse both; the per-sequence wrapper refuses a cache or padding mask on a packed row,
``position_ids`` that are not ``[batch, tokens]``, hidden states unlike the
``position_ids``, and a second install.
"""

import importlib.util
import re

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs transformers", allow_module_level=True)

import torch

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.model.linear_attention import check_packing
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.engines import linear_packed, ulysses
from areal_fn.runtime.engines.fsdp2 import build_hf_model
from tests.distributed import dsa_configs, gated_delta_configs


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_linear_attention_refuses_ulysses(name: str) -> None:
    spec = model_from_hf_config(getattr(gated_delta_configs, name)())
    with pytest.raises(
        LayoutError,
        match=re.escape(
            f"cp=2: {name}'s linear-attention layers carry a recurrent state that must see the "
            "whole sequence in order, and Ulysses and context parallelism would run it over "
            "one rank's part of each sequence; use c=1"
        ),
    ):
        fsdp2_layout(spec, "fsdp:d2c2")


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_refuses_packed_rows(name: str) -> None:
    spec = model_from_hf_config(getattr(dsa_configs, name)())
    with pytest.raises(
        LayoutError,
        match=re.escape(
            f"packed sequences are refused: {name}'s indexer (transformers) scores every key "
            "of the row inside its attention module, outside the attention function the "
            "engines replace for Ulysses and packing, so it would pick its top-k from one "
            "rank's shard of the sequence or across packed sequences"
        ),
    ):
        check_packing(spec)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    spec = model_from_hf_config(gated_delta_configs.qwen3_5_text())
    out = build_hf_model(spec, seed=0)
    ulysses.install(out, None)
    linear_packed.install(out, spec)
    return out


PACKED = {
    "input_ids": torch.arange(1, 9)[None],
    "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
}


def test_packed_row_with_a_cache(model: torch.nn.Module) -> None:
    with pytest.raises(
        LayoutError,
        match=re.escape(
            "model.layers.0.linear_attn: a packed row (several sequences, position_ids "
            "restarting at 0) given cache; packed rows run without a cache or padding mask "
            "(use_cache=False, no attention_mask), or one sequence per row"
        ),
    ):
        model(**PACKED, use_cache=True)


def test_packed_row_with_a_padding_mask(model: torch.nn.Module) -> None:
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, -1] = 0
    with pytest.raises(LayoutError, match=r"linear_attn: a packed row .* given attention_mask;"):
        model(**PACKED, attention_mask=mask, use_cache=False)


def test_hidden_states_unlike_the_position_ids(model: torch.nn.Module) -> None:
    model(**PACKED, use_cache=False)  # the layers now hold that row's sequences
    module = model.get_submodule("model.layers.0.linear_attn")
    with pytest.raises(
        LayoutError,
        match=re.escape(
            "model.layers.0.linear_attn: hidden states of shape (1, 5, 16) but position_ids "
            "of 1 rows of 8 tokens"
        ),
    ):
        module(hidden_states=torch.zeros(1, 5, 16))


def test_position_ids_not_batch_by_tokens() -> None:
    with pytest.raises(
        LayoutError,
        match=re.escape(
            "position_ids of shape (3, 1, 8) reached a linear-attention layer; packed rows "
            "need [batch, tokens] position_ids"
        ),
    ):
        linear_packed.sequence_spans(torch.zeros(3, 1, 8, dtype=torch.long))


def test_install_twice(model: torch.nn.Module) -> None:
    spec = model_from_hf_config(gated_delta_configs.qwen3_5_text())
    with pytest.raises(
        LayoutError,
        match=re.escape(
            "model.layers.0.linear_attn: linear_packed.install was already called on this model"
        ),
    ):
        linear_packed.install(model, spec)
