"""Invalid inputs of the families with sliding layers and per-layer-type rope (OLMo 3,
Gemma 3 text), and the layouts they cannot have: one table of (call, error, regex)."""

from collections.abc import Callable

import pytest

from areal_fn import ParallelDims, fsdp2_layout, megatron_layout
from areal_fn.errors import LayoutError, SpecError, UnsupportedConfigError
from areal_fn.model.spec import model_from_hf_config

OLMO3: dict[str, object] = {
    "model_type": "olmo3",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
}
GEMMA3: dict[str, object] = {**OLMO3, "model_type": "gemma3_text", "head_dim": 8}


def cfg(base: dict[str, object], **changes: object) -> Callable[[], object]:
    return lambda: model_from_hf_config({**base, **changes})


def _nested(full: dict[str, object], sliding: dict[str, object]) -> dict[str, object]:
    return {"full_attention": full, "sliding_attention": sliding}


CASES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        "olmo3 top-level rope_theta other than the class default",
        cfg(OLMO3, rope_theta=10000.0),
        UnsupportedConfigError,
        r"^olmo3 config has rope_theta=10000.0 at the top level; transformers' olmo3 config "
        r"applies it to the full-attention layers only and rotates the sliding ones with its "
        r"default 500000.0, which the olmo3 family \(one base\) does not model; nest "
        r"rope_parameters by layer type",
    ),
    (
        "olmo3 nested rope with two bases",
        cfg(
            OLMO3,
            rope_parameters=_nested(
                {"rope_type": "default", "rope_theta": 1e6}, {"rope_theta": 1e4}
            ),
        ),
        UnsupportedConfigError,
        r"^olmo3 config has rope_theta=1000000.0 on full-attention layers and 10000.0 on "
        r"sliding ones; the olmo3 family rotates both with one base",
    ),
    (
        "gemma3_text nested rope scaling on sliding layers",
        cfg(
            GEMMA3,
            rope_parameters=_nested(
                {"rope_type": "default", "rope_theta": 1e6},
                {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            ),
        ),
        UnsupportedConfigError,
        r"^gemma3_text config has rope_parameters.sliding_attention.rope_type='linear'; the "
        r"gemma3_text family scales the rope of its full-attention layers only",
    ),
    (
        "gemma3_text nested rope with a third layer type",
        cfg(GEMMA3, rope_parameters={**_nested({}, {}), "chunked_attention": {}}),
        SpecError,
        r"^gemma3_text config has rope_parameters=.*; nested by layer type it holds one "
        r"mapping for each of \['full_attention', 'sliding_attention'\] and nothing else$",
    ),
    (
        "gemma3_text local base given twice, differently",
        cfg(
            GEMMA3,
            rope_local_base_freq=10000.0,
            rope_parameters=_nested({"rope_theta": 1e6}, {"rope_theta": 5e3}),
        ),
        SpecError,
        r"^config sets rope_local_base_freq=10000.0 and rope_parameters.sliding_attention."
        r"rope_theta=5000.0; they must agree$",
    ),
    (
        "gemma3_text another activation",
        cfg(GEMMA3, hidden_activation="silu"),
        UnsupportedConfigError,
        r"^gemma3_text config has hidden_activation='silu'; the gemma3_text family models a "
        r"gated MLP with hidden_activation='gelu_pytorch_tanh' only",
    ),
    (
        "gemma3_text final logit soft-capping",
        cfg(GEMMA3, final_logit_softcapping=30.0),
        UnsupportedConfigError,
        r"^gemma3_text config has final_logit_softcapping=30.0; the gemma3_text family models "
        r"final_logit_softcapping=None only",
    ),
    (
        "gemma3_text attention soft-capping",
        cfg(GEMMA3, attn_logit_softcapping=50.0),
        UnsupportedConfigError,
        r"^gemma3_text config has attn_logit_softcapping=50.0; the gemma3_text family models "
        r"attn_logit_softcapping=None only",
    ),
    (
        "gemma3_text bidirectional attention",
        cfg(GEMMA3, use_bidirectional_attention=True),
        UnsupportedConfigError,
        r"^gemma3_text config has use_bidirectional_attention=True; the gemma3_text family "
        r"models use_bidirectional_attention=False only",
    ),
    (
        "gemma3_text without a window",
        cfg(GEMMA3, sliding_window=None),
        UnsupportedConfigError,
        r"^gemma3_text config has sliding_window=None; .* give a window \(4096 is the config "
        r"class's default\)$",
    ),
    (
        "olmo3 on Megatron",
        lambda: megatron_layout(model_from_hf_config(OLMO3), ParallelDims()),
        LayoutError,
        r"^Megatron-Core 0.16's GPTModel cannot express olmo3: its layer has no norm on the "
        r"attention and MLP outputs \(post_attention_layernorm, post_feedforward_layernorm\) "
        r"and its q_layernorm normalises each head, not the whole q/k projection; use the "
        r"fsdp backend$",
    ),
    (
        "gemma3_text on Megatron",
        lambda: megatron_layout(model_from_hf_config(GEMMA3), "megatron:t2p2"),
        LayoutError,
        r"^Megatron-Core 0.16's GPTModel cannot express gemma3_text: its layer has no norm on "
        r"the attention and MLP outputs, its embedding has no sqrt\(hidden_size\) scale, it "
        r"rotates every layer with one rope base .*zero_centered_gamma\); use the fsdp backend$",
    ),
    (
        "olmo3 under FSDP2 tensor parallelism",
        lambda: fsdp2_layout(model_from_hf_config(OLMO3), "fsdp:d2t2"),
        LayoutError,
        r"^tp=2: olmo3's q_norm/k_norm normalise the whole q and k projections, which "
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


def test_sliding_window_refusal_stays_for_families_without_it() -> None:
    """The families that do not model sliding windows still refuse them."""
    with pytest.raises(UnsupportedConfigError, match=r"^llama config has layer_types\[0\]="):
        model_from_hf_config(
            {**OLMO3, "model_type": "llama", "layer_types": ["sliding_attention"] * 4}
        )
    with pytest.raises(UnsupportedConfigError, match=r"^qwen3 config turns on sliding-window"):
        model_from_hf_config(
            {
                **OLMO3,
                "model_type": "qwen3",
                "head_dim": 4,
                "use_sliding_window": True,
                "max_window_layers": 2,
            }
        )
