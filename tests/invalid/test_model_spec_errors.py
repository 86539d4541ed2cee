"""Invalid inputs to model specs, HF conversion and vocab padding: one table of (call, error, regex)."""

import json
import re
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

from areal_fn.errors import ConversionError, SpecError, UnsupportedConfigError
from areal_fn.layouts.vocab import padded_vocab_size
from areal_fn.model.families import FAMILIES
from areal_fn.model.hf_memory import canonical_to_hf_state, hf_state_to_canonical
from areal_fn.model.spec import model_from_hf_config

BASE: dict[str, dict[str, object]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32,
        "sliding_window": None,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
}


GPT_OSS: dict[str, object] = {
    "model_type": "gpt_oss",
    "hidden_size": 8,
    "intermediate_size": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 16,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
}


def cfg(base: str, **changes: object) -> Callable[[], object]:
    """A call building a spec from ``BASE[base]`` with keys changed (``None`` deletes)."""

    def call() -> object:
        c = dict(BASE[base])
        for k, v in changes.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
        return model_from_hf_config(c)

    return call


def spec(base: str = "llama", **kw: object):  # type: ignore[no-untyped-def]
    return model_from_hf_config(dict(BASE[base], **kw))


def evolve(**changes: object) -> Callable[[], object]:
    return lambda: attrs.evolve(spec(), **changes)


def _moe_state() -> dict[str, torch.Tensor]:
    s = spec("qwen3_moe")
    return {t.name: torch.zeros(t.shape) for t in s.tensors}


def _drop(d: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in d.items() if k != name}


def _tied_mismatch() -> object:
    s = spec(tie_word_embeddings=True)
    sd = canonical_to_hf_state({t.name: torch.zeros(t.shape) for t in s.tensors}, s)
    sd["lm_head.weight"] = torch.ones_like(sd["lm_head.weight"])
    return hf_state_to_canonical(sd, s)


def _bad_json(tmp: Path) -> object:
    p = tmp / "config.json"
    p.write_text("{not json")
    return model_from_hf_config(p)


def _json_list(tmp: Path) -> object:
    p = tmp / "config.json"
    p.write_text(json.dumps([1, 2]))
    return model_from_hf_config(tmp)


def _bad_in_file(tmp: Path) -> object:
    p = tmp / "Tiny.json"
    p.write_text(json.dumps(dict(BASE["llama"], num_key_value_heads=3)))
    return model_from_hf_config(p)


CASES: list[tuple[str, Callable[..., object], type[Exception], str]] = [
    # -- config.json problems ----------------------------------------------------------
    (
        "unsupported model_type",
        cfg("llama", model_type="gpt2"),
        SpecError,
        # every registered family, sorted (a new family module adds itself)
        r"model_type='gpt2' is not supported; supported model types are "
        + re.escape(repr(sorted(FAMILIES)))
        + r"; add a family module under areal_fn/model/families/ for it$",
    ),
    (
        "mistral window by default",
        cfg("mistral", sliding_window=None),
        UnsupportedConfigError,
        r"^mistral config has sliding_window=4096 \(the config-class default\): every mistral "
        r"layer then attends to a window of 4096 tokens, but the family models full causal "
        r"attention only; set sliding_window to null \(as Mistral-7B-v0.3 and Mixtral configs "
        r"do\) or use a model without a sliding window$",
    ),
    (
        "mixtral window",
        cfg("mixtral", sliding_window=8),
        UnsupportedConfigError,
        r"^mixtral config has sliding_window=8: every mixtral layer then attends to a window "
        r"of 8 tokens",
    ),
    (
        "mixtral with qwen's expert count key",
        cfg("mixtral", num_experts=4, num_local_experts=None),
        UnsupportedConfigError,
        r"^mixtral config sets num_experts=4, which transformers' mixtral config class does "
        r"not have \(it would be ignored\); remove it and use num_local_experts$",
    ),
    (
        "mixtral with an expert width of its own",
        cfg("mixtral", moe_intermediate_size=8),
        UnsupportedConfigError,
        r"sets moe_intermediate_size=8.*use intermediate_size \(the experts' width\)$",
    ),
    (
        "mixtral router noise",
        cfg("mixtral", router_jitter_noise=0.1),
        UnsupportedConfigError,
        r"^mixtral config has router_jitter_noise=0.1; the mixtral family models "
        r"router_jitter_noise=0.0 only \(the engines and the Megatron builder compute it so\), "
        r"so this model would compute differently; set router_jitter_noise to 0.0$",
    ),
    (
        "mixtral spec with a dense layer",
        lambda: attrs.evolve(spec("mixtral"), moe_layers=(True, False)),
        SpecError,
        r"moe_layers=\(True, False\) has dense layers, but every mixtral layer is an MoE "
        r"layer \(the family has no dense MLP\)$",
    ),
    (
        "mixtral spec with separate expert width",
        lambda: attrs.evolve(spec("mixtral"), moe_intermediate_size=8),
        SpecError,
        r"^ModelSpec.moe_intermediate_size=8 but intermediate_size=24; the mixtral family has "
        r"no separate moe_intermediate_size \(it is intermediate_size\)$",
    ),
    (
        "no model_type",
        cfg("llama", model_type=None),
        SpecError,
        r"config has model_type=None.*one of \['deepseek_v3', 'deepseek_v32', 'gemma3_text', 'glm4_moe', "
        r"'glm_moe_dsa', 'gpt_oss', 'llama'",
    ),
    (
        "missing hidden_size",
        cfg("llama", hidden_size=None),
        SpecError,
        r"llama config is missing required field\(s\) \['hidden_size'\]",
    ),
    (
        "missing moe fields",
        cfg("qwen3_moe", num_experts=None, moe_intermediate_size=None),
        SpecError,
        r"qwen3_moe config is missing required field\(s\) \['num_experts', 'moe_intermediate_size'\]",
    ),
    (
        "qwen3 needs head_dim",
        cfg("qwen3_moe", model_type="qwen3", head_dim=None),
        SpecError,
        r"qwen3 config is missing required field\(s\) \['head_dim'\]",
    ),
    (
        "qwen2 needs kv heads",
        cfg("llama", model_type="qwen2", num_key_value_heads=None),
        SpecError,
        r"qwen2 config is missing required field\(s\) \['num_key_value_heads'\]",
    ),
    (
        "heads not divisible by kv heads",
        cfg("llama", num_key_value_heads=3),
        SpecError,
        r"num_key_value_heads=3 does not divide num_attention_heads=4",
    ),
    (
        "hidden not divisible, no head_dim",
        cfg("qwen3_moe", hidden_size=18, head_dim=None),
        SpecError,
        r"hidden_size=18 is not divisible by num_attention_heads=4 and the config has no head_dim; give head_dim",
    ),
    (
        "llama hidden not divisible even with head_dim",
        cfg("llama", hidden_size=18, head_dim=4),
        SpecError,
        r"hidden_size=18 is not divisible by num_attention_heads=4; llama requires it",
    ),
    ("odd head_dim", cfg("qwen3_moe", head_dim=5), SpecError, r"head_dim=5 is odd; rotary"),
    (
        "negative intermediate",
        cfg("llama", intermediate_size=-1),
        SpecError,
        r"intermediate_size=-1 must be an int >= 1",
    ),
    (
        "zero layers",
        cfg("llama", num_hidden_layers=0),
        SpecError,
        r"num_hidden_layers=0 must be an int >= 1",
    ),
    (
        "float size",
        cfg("llama", vocab_size=32.0),
        SpecError,
        r"vocab_size=32.0 must be an int >= 1",
    ),
    (
        "bool size",
        cfg("llama", hidden_size=True),
        SpecError,
        r"hidden_size=True must be an int >= 1",
    ),
    (
        "string flag",
        cfg("llama", tie_word_embeddings="yes"),
        SpecError,
        r"tie_word_embeddings='yes' must be true or false",
    ),
    (
        "bad eps",
        cfg("llama", rms_norm_eps=0),
        SpecError,
        r"rms_norm_eps=0 must be a finite number > 0",
    ),
    (
        "bad rope_theta",
        cfg("llama", rope_theta=-1.0),
        SpecError,
        r"rope_theta=-1.0 must be a finite number > 0",
    ),
    (
        "rope_theta disagrees",
        cfg("llama", rope_theta=1.0, rope_parameters={"rope_theta": 2.0}),
        SpecError,
        r"rope_theta=1.0 and rope_parameters.rope_theta=2.0; they must agree",
    ),
    (
        "rope_scaling not a mapping",
        cfg("llama", rope_scaling=0),
        SpecError,
        r"rope_scaling=0 must be a mapping or null",
    ),
    # -- computations the family does not model ------------------------------------------
    (
        "hidden_act other than silu",
        cfg("llama", hidden_act="gelu"),
        UnsupportedConfigError,
        r"llama config has hidden_act='gelu'; the llama family models a gated MLP with "
        r"hidden_act='silu' only \(the engines and the Megatron builder apply silu\), so this "
        r"model would compute differently; use a config with hidden_act='silu'",
    ),
    (
        "qwen2 sliding window from max_window_layers",
        cfg("llama", model_type="qwen2", use_sliding_window=True, max_window_layers=1),
        UnsupportedConfigError,
        r"qwen2 config turns on sliding-window attention \(use_sliding_window=true, "
        r"sliding_window=4096\) for 1 of 2 layers \[1\] \(layers with index >= "
        r"max_window_layers=1\); the qwen2 family models full causal attention only, so those "
        r"layers would attend to the whole context; set use_sliding_window to false",
    ),
    (
        "qwen3 sliding window from layer_types",
        cfg(
            "qwen3_moe",
            model_type="qwen3",
            use_sliding_window=True,
            sliding_window=16,
            layer_types=["full_attention", "sliding_attention"] * 2,
        ),
        UnsupportedConfigError,
        r"qwen3 config turns on sliding-window attention \(use_sliding_window=true, "
        r"sliding_window=16\) for 2 of 4 layers \[1, 3\] \(the layers layer_types marks "
        r"'sliding_attention'\)",
    ),
    (
        "qwen3_moe sliding window on every layer",
        cfg("qwen3_moe", use_sliding_window=True, sliding_window=16, max_window_layers=4),
        UnsupportedConfigError,
        r"qwen3_moe config turns on sliding-window attention \(use_sliding_window=true, "
        r"sliding_window=16\) for 4 of 4 layers \[0, 1, 2, 3\] \(every layer\)",
    ),
    (
        "gpt_oss without a window",
        lambda: model_from_hf_config({**GPT_OSS, "sliding_window": None}),
        UnsupportedConfigError,
        r"gpt_oss config has sliding_window=None; transformers' gpt_oss model builds a "
        r"sliding-window mask in every forward and fails without a window \(even with every "
        r"layer full_attention\); give a window \(128 is the config class's default\)$",
    ),
    (
        "gpt_oss with moe_intermediate_size",
        lambda: model_from_hf_config({**GPT_OSS, "moe_intermediate_size": 4}),
        UnsupportedConfigError,
        r"gpt_oss config sets moe_intermediate_size=4, which transformers' gpt_oss config class "
        r"does not have \(it would be ignored\); remove it and use intermediate_size \(the "
        r"experts' width\)$",
    ),
    (
        "llama with a sliding window",
        cfg("llama", sliding_window=4096),
        UnsupportedConfigError,
        r"llama config has sliding_window=4096, but the llama family has no sliding-window "
        r"attention \(transformers ignores the key for llama, so every layer would attend to the "
        r"whole context\); set sliding_window to null",
    ),
    (
        "llama layer marked sliding",
        cfg("llama", layer_types=["full_attention", "sliding_attention"]),
        UnsupportedConfigError,
        r"llama config has layer_types\[1\]='sliding_attention'; the llama family models "
        r"'full_attention' layers only; use a model whose layers are all 'full_attention'",
    ),
    (
        "qwen2 layer of another attention kind",
        cfg("llama", model_type="qwen2", layer_types=["full_attention", "linear_attention"]),
        UnsupportedConfigError,
        r"qwen2 config has layer_types\[1\]='linear_attention'; the qwen2 family models "
        r"'full_attention' layers \(and 'sliding_attention' ones while use_sliding_window is "
        r"false\) only",
    ),
    (
        "layer_types length",
        cfg("llama", layer_types=["full_attention"]),
        SpecError,
        r"layer_types has 1 entries but num_hidden_layers=2; give one attention kind per layer",
    ),
    (
        "use_sliding_window not a bool",
        cfg("llama", model_type="qwen2", use_sliding_window="no"),
        SpecError,
        r"use_sliding_window='no' must be true or false",
    ),
    (
        "rope type nobody implements",
        cfg("llama", rope_scaling={"type": "mrope", "mrope_section": [2, 2]}),
        UnsupportedConfigError,
        r"llama config has rope scaling rope_type='mrope', which the llama family does not "
        r"model; known rope types are \['default', 'dynamic', 'linear', 'llama3', 'longrope', "
        r"'yarn'\] \(transformers' implementations, which the FSDP2 engine applies; the "
        r"Megatron builder applies 'llama3' only\); use one of them or no rope scaling",
    ),
    (
        "rope_parameters type nobody implements",
        cfg("qwen3_moe", rope_parameters={"rope_type": "proportional", "rope_theta": 1e6}),
        UnsupportedConfigError,
        r"qwen3_moe config has rope scaling rope_type='proportional'",
    ),
    (
        "partial rotary",
        cfg("llama", partial_rotary_factor=0.5),
        UnsupportedConfigError,
        r"llama config has partial_rotary_factor=0.5: rotary embeddings on part of each head; "
        r"the llama family rotates all head_dim dims \(so do the engines and the Megatron "
        r"builder\); use a config without partial_rotary_factor \(or 1.0\)",
    ),
    (
        "partial rotary in rope_parameters",
        cfg("llama", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}),
        UnsupportedConfigError,
        r"llama config has rope scaling partial_rotary_factor=0.25: rotary embeddings on part",
    ),
    (
        "unknown dtype",
        cfg("llama", torch_dtype="float8"),
        SpecError,
        r"torch_dtype: dtype='float8' is not a known dtype",
    ),
    (
        "mlp_only_layers out of range",
        cfg("qwen3_moe", mlp_only_layers=[1, 4]),
        SpecError,
        r"mlp_only_layers=\[1, 4\] contains 4, outside range\(0, 4\) \(num_hidden_layers=4\)",
    ),
    (
        "mlp_only_layers not a list",
        cfg("qwen3_moe", mlp_only_layers=3),
        SpecError,
        r"mlp_only_layers=3 must be a list",
    ),
    (
        "decoder_sparse_step zero",
        cfg("qwen3_moe", decoder_sparse_step=0),
        SpecError,
        r"decoder_sparse_step=0 must be an int >= 1",
    ),
    (
        "top-k above experts",
        cfg("qwen3_moe", num_experts_per_tok=5),
        SpecError,
        r"num_experts_per_tok=5 must be in 1..num_experts=4",
    ),
    (
        "zero experts",
        cfg("qwen3_moe", num_experts=0),
        SpecError,
        r"num_experts=0 must be an int >= 1",
    ),
    (
        "expert alias conflict",
        cfg("qwen3_moe", num_local_experts=8),
        SpecError,
        r"both num_experts=4 and num_local_experts=8; they name the same field",
    ),
    # -- files ---------------------------------------------------------------------------
    (
        "no such file",
        lambda: model_from_hf_config("/nonexistent/dir"),
        SpecError,
        r"no config file at '/nonexistent/dir/?",
    ),
    ("invalid json", _bad_json, SpecError, r"is not valid JSON"),
    ("json not an object", _json_list, SpecError, r"holds a JSON list, not an object"),
    (
        "error names the file",
        _bad_in_file,
        SpecError,
        r"Tiny\.json: num_key_value_heads=3 does not divide",
    ),
    # -- ModelSpec records -----------------------------------------------------------------
    (
        "qwen2 cannot drop qkv bias",
        lambda: attrs.evolve(spec(model_type="qwen2"), qkv_bias=False),
        SpecError,
        r"qwen2 has qkv_bias=True by construction, got qkv_bias=False",
    ),
    (
        "llama biases go together",
        evolve(qkv_bias=True),
        SpecError,
        r"llama sets qkv_bias and o_bias together from config key 'attention_bias'",
    ),
    (
        "moe_layers length",
        evolve(moe_layers=(False,)),
        SpecError,
        r"moe_layers has 1 entries but num_layers=2",
    ),
    (
        "dense family with experts",
        evolve(num_experts=2),
        SpecError,
        r"llama is a dense family but num_experts",
    ),
    (
        "moe_layers not bools",
        evolve(moe_layers=(0, 1)),
        SpecError,
        r"moe_layers has 0; every entry must be a bool",
    ),
    (
        "negative field",
        evolve(vocab_size=-3),
        SpecError,
        r"ModelSpec.vocab_size=-3 must be an int >= 1",
    ),
    (
        "unknown tensor",
        lambda: spec().tensor("model.layers.9.mlp.up_proj.weight"),
        SpecError,
        r"llama model has no tensor 'model.layers.9.mlp.up_proj.weight' among its 21 canonical tensors; similar names",
    ),
    (
        "layer out of range",
        lambda: spec().layer_tensors(2),
        SpecError,
        r"layer=2 is out of range; the model has num_layers=2",
    ),
    # -- conversion ------------------------------------------------------------------------
    (
        "canonical missing a tensor",
        lambda: canonical_to_hf_state(_drop(_moe_state(), "model.norm.weight"), spec("qwen3_moe")),
        ConversionError,
        r"canonical tensors does not match the qwen3_moe spec: missing 1 tensor\(s\) \['model.norm.weight'\]",
    ),
    (
        "canonical extra tensor",
        lambda: canonical_to_hf_state(dict(_moe_state(), extra=torch.zeros(1)), spec("qwen3_moe")),
        ConversionError,
        r"1 unexpected tensor\(s\) \['extra'\]",
    ),
    (
        "canonical wrong shape",
        lambda: canonical_to_hf_state(
            dict(_moe_state(), **{"model.norm.weight": torch.zeros(3)}), spec("qwen3_moe")
        ),
        ConversionError,
        r"canonical tensor 'model.norm.weight' has shape \(3,\), the spec says \(16,\)",
    ),
    (
        "fused parts disagree on dtype",
        lambda: canonical_to_hf_state(
            dict(
                _moe_state(),
                **{
                    "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(
                        8, 16, dtype=torch.float16
                    )
                },
            ),
            spec("qwen3_moe"),
        ),
        ConversionError,
        r"'model.layers.0.mlp.experts.gate_up_proj' fuses 8 canonical tensors with different dtypes",
    ),
    (
        "state_dict with per-expert names",
        lambda: hf_state_to_canonical(_moe_state(), spec("qwen3_moe")),
        ConversionError,
        r"state_dict does not match the qwen3_moe spec: missing 8 tensor\(s\) \['model.layers.0.mlp.experts.gate_up_proj'",
    ),
    (
        "tied lm_head differs",
        _tied_mismatch,
        ConversionError,
        r"'lm_head.weight' should alias 'model.embed_tokens.weight' \(tie_word_embeddings=True\)",
    ),
    # -- vocab padding -----------------------------------------------------------------------
    (
        "tp zero",
        lambda: padded_vocab_size(100, tp=0),
        SpecError,
        r"padded_vocab_size: tp=0 must be an int >= 1",
    ),
    (
        "vocab zero",
        lambda: padded_vocab_size(0, tp=1),
        SpecError,
        r"vocab_size=0 must be an int >= 1",
    ),
    (
        "divisible_by zero",
        lambda: padded_vocab_size(10, tp=1, divisible_by=0),
        SpecError,
        r"divisible_by=0 must be",
    ),
]

#: Calls that take the test's tmp_path.
_NEEDS_TMP = (_bad_json, _json_list, _bad_in_file)


@pytest.mark.parametrize(
    ("call", "error", "regex"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid(
    call: Callable[..., object], error: type[Exception], regex: str, tmp_path: Path
) -> None:
    with pytest.raises(error, match=regex):
        if call in _NEEDS_TMP:
            call(tmp_path)
        else:
            call()
