"""Invalid MiniMax-M2 configs (keys transformers ignores but a config could set against
the model, ``rotary_dim``) and the layouts it cannot have: one table of (call, error,
regex)."""

from collections.abc import Callable

import pytest

from areal_fn import ParallelDims, fsdp2_layout, megatron_layout
from areal_fn.errors import LayoutError, SpecError, UnsupportedConfigError
from areal_fn.model.spec import model_from_hf_config

MINIMAX: dict[str, object] = {
    "model_type": "minimax_m2",
    "hidden_size": 16,
    "intermediate_size": 12,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def cfg(**changes: object) -> Callable[[], object]:
    return lambda: model_from_hf_config({**MINIMAX, **changes})


CASES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        "q/k norms switched off",
        cfg(use_qk_norm=False),
        UnsupportedConfigError,
        r"^minimax_m2 config has use_qk_norm=False; the minimax_m2 family models "
        r"use_qk_norm=True only .*; set use_qk_norm to True$",
    ),
    (
        "per-head q/k norms",
        cfg(qk_norm_type="per_head"),
        UnsupportedConfigError,
        r"^minimax_m2 config has qk_norm_type='per_head'; the minimax_m2 family models "
        r"qk_norm_type='per_layer' only",
    ),
    (
        "softmax scoring",
        cfg(scoring_func="softmax"),
        UnsupportedConfigError,
        r"^minimax_m2 config has scoring_func='softmax'; .* scoring_func='sigmoid' only",
    ),
    (
        "shared experts",
        cfg(shared_intermediate_size=64),
        UnsupportedConfigError,
        r"^minimax_m2 config has shared_intermediate_size=64; .*shared_intermediate_size=0 only",
    ),
    (
        "router noise",
        cfg(router_jitter_noise=0.1),
        UnsupportedConfigError,
        r"^minimax_m2 config has router_jitter_noise=0.1; .* router_jitter_noise=0.0 only",
    ),
    (
        "rotary_dim above head_dim",
        cfg(rotary_dim=16),
        SpecError,
        r"^rotary_dim=16 must be an even number of dims at most head_dim=8$",
    ),
    (
        "odd rotary_dim",
        cfg(rotary_dim=3),
        SpecError,
        r"^rotary_dim=3 must be an even number of dims at most head_dim=8$",
    ),
    (
        "rotary_dim against partial_rotary_factor",
        cfg(rotary_dim=4, partial_rotary_factor=1.0),
        SpecError,
        r"^config sets rotary_dim=4 \(a factor of 0.5 of head_dim=8\) and "
        r"partial_rotary_factor=1.0; they must agree$",
    ),
    (
        "num_experts instead of num_local_experts",
        cfg(num_experts=4),
        SpecError,
        r"num_experts.*num_local_experts",
    ),
    (
        "on Megatron",
        lambda: megatron_layout(model_from_hf_config(MINIMAX), ParallelDims()),
        LayoutError,
        r"^Megatron-Core 0.16's GPTModel cannot express minimax_m2: its q_layernorm "
        r"normalises each head, not the whole q/k projection; use the fsdp backend$",
    ),
    (
        "under FSDP2 tensor parallelism",
        lambda: fsdp2_layout(model_from_hf_config(MINIMAX), "fsdp:d2t2"),
        LayoutError,
        r"^tp=2: minimax_m2's q_norm/k_norm normalise the whole q and k projections, which "
        r"column-wise TP splits by heads \(the FSDP2 engine would norm each rank's heads "
        r"alone\); use tp in \{1\}$",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid(call: Callable[[], object], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        call()
