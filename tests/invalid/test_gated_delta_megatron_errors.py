"""What Megatron-Core 0.16 cannot do with the gated-delta-net families (Qwen3-Next,
Qwen3.5), each refusal with its message pinned: context parallelism, a ``tp`` that
splits a key head or the gated shared expert unevenly, the Transformer-Engine naming,
Megatron's own ``torch_dist`` checkpoints and packed rows in the Megatron engine."""

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from areal_fn import megatron_layout, model_from_hf_config
from areal_fn.errors import CheckpointError, LayoutError
from areal_fn.strategy.allocation import ParallelDims
from tests.distributed import gated_delta_configs


def _spec(**kw: object) -> Any:
    return model_from_hf_config({**gated_delta_configs.qwen3_next(), **kw})


def _mcore_keys(spec: Any) -> Any:
    from areal_fn.runtime.checkpoint.megatron_keys import mcore_keys

    return mcore_keys(spec, "local", "per-layer")


def _packed(spec: Any) -> Any:
    """The Megatron engine's packing step on a stand-in holding only what it reads."""
    from areal_fn.runtime.engines.megatron_steps import MegatronSteps
    from areal_fn.runtime.engines.packed import TokenSequence

    engine = types.SimpleNamespace(spec=spec, dims=ParallelDims(), _te_cp=False)
    seqs = [
        TokenSequence(input_ids=torch.arange(1, 4)),
        TokenSequence(input_ids=torch.arange(4, 7)),
    ]
    return MegatronSteps._packed(engine, seqs, 8)  # type: ignore[arg-type]


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "context parallelism",
        lambda: megatron_layout(_spec(), "megatron:d2c2"),
        LayoutError,
        "cp=2: Megatron-Core 0.16's GatedDeltaNet has no context parallelism (qwen3_next's "
        "linear-attention layers; its TransformerConfig asserts 'Gated delta net does not "
        "support context parallel for now'); use cp=1",
    ),
    (
        "tp splits a key head",
        lambda: megatron_layout(_spec(num_key_value_heads=4), "megatron:t4"),
        LayoutError,
        "tp=4 does not divide linear_num_key_heads=2 (qwen3_next); Megatron-Core's "
        "GatedDeltaNet gives every TP rank whole key heads and their value heads; use tp in "
        "{1, 2}",
    ),
    (
        "tp splits the gated shared expert unevenly",
        lambda: megatron_layout(
            _spec(num_key_value_heads=4, linear_num_key_heads=4, shared_expert_intermediate_size=6),
            "megatron:t4",
        ),
        LayoutError,
        "tp=4 does not divide shared_expert_intermediate_size=6 (qwen3_next); Megatron shards "
        "the gated shared expert's channels over TP; use tp in {1, 2}",
    ),
    (
        "Transformer-Engine naming",
        lambda: megatron_layout(_spec(), "megatron:d4", naming="te"),
        LayoutError,
        "naming='te' for qwen3_next: the Transformer-Engine spec's GatedDeltaNet out_norm is "
        "zero-centred ((1 + w), as every norm of the model), while the checkpoint's "
        "linear_attn.norm.weight is the plain w of a gated RMSNorm: the values differ by 1, no "
        "piece of the canonical tensor; use naming='local' (the spec this project builds)",
    ),
    (
        "torch_dist checkpoint keys",
        lambda: _mcore_keys(_spec()),
        CheckpointError,
        "qwen3_next: Megatron-Core's dist_checkpointing stores each GatedDeltaNet's in_proj and "
        "conv1d cut into query/key/value/z/beta/alpha sub-tensors, keys this interop does not "
        "map, and its Transformer-Engine out_norm holds w - 1; use the per-rank files "
        "(areal-fn convert --format rank-files) or HF checkpoints instead",
    ),
    (
        "packed rows in the Megatron engine",
        lambda: _packed(_spec()),
        LayoutError,
        "packed sequences for qwen3_next: Megatron-Core 0.16's GatedDeltaNet ignores the "
        "attention mask and refuses PackedSeqParams ('GDN does not support packed sequence "
        "for now'), so its recurrence would run from one sequence into the next; pass one "
        "sequence per row (train_step)",
    ),
]


@pytest.mark.parametrize(("what", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_refused_with_the_reason(
    what: str, call: Callable[[], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as got:
        call()
    assert type(got.value) is error, what
    assert str(got.value) == message, what


def test_the_same_configs_build_without_the_refused_option() -> None:
    """Each refused call's model has a Megatron layout without the refused option."""
    assert megatron_layout(_spec(), "megatron:d2t2").world_size == 4
    assert megatron_layout(_spec(num_key_value_heads=4), "megatron:t2").world_size == 2
