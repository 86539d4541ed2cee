"""Laws of ModelSpec, the HF memory view, and vocab padding; published parameter counts."""

import copy
import json
import math
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.layouts.vocab import padded_vocab_size, vocab_padding
from areal_fn.model.hf_memory import hf_memory_view
from areal_fn.model.linear_attention import LinearAttention  # noqa: F401 (eval of a repr)
from areal_fn.model.spec import ModelSpec, load_hf_config, model_from_hf_config
from areal_fn.model.tensor_spec import TensorSpec
from areal_fn.sharding.box import Box
from areal_fn.testing.models import FAMILY_NAMES, gpt_oss_layer_types, hf_configs, model_specs

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"

#: Published totals (billions) and the exact counts of the released checkpoints (None
#: where no exact count is published for this config).
PUBLISHED = {
    "Qwen2.5-0.5B": (0.49, 494_032_768),
    "Qwen2.5-7B": (7.6, 7_615_616_512),
    "Qwen2.5-72B": (72.7, 72_706_203_648),
    "Qwen3-8B": (8.2, 8_190_735_360),
    "Qwen3-30B-A3B": (30.5, 30_532_122_624),
    "Qwen3-235B-A22B": (235.0, 235_093_634_560),
    "Llama-3.2-1B": (1.24, 1_235_814_400),
    "Llama-3.1-8B": (8.0, 8_030_261_248),
    "Llama-3.1-70B": (70.6, 70_553_706_496),
    "Llama-3.1-405B": (405.0, 405_853_388_800),
    "Mistral-7B-v0.3": (7.25, 7_248_023_552),
    "Mixtral-8x7B-v0.1": (46.7, 46_702_792_704),
    "Mixtral-8x22B-v0.1": (141.0, None),
    "GLM-4.5": (355.0, None),
    "GLM-4.5-Air": (106.0, None),
    "DeepSeek-V3": (671.0, None),
    # the Hugging Face page's 685B counts the multi-token-prediction layer (MTP_COUNTED);
    # Z.ai's GLM-5 card: 744B total
    "DeepSeek-V3.2-Exp": (685.0, None),
    "GLM-5": (744.0, None),
    "Kimi-K2-Instruct": (1000.0, None),
    # OpenAI's model card: 116.83B and 20.91B total (MXFP4 experts counted as parameters)
    "gpt-oss-120b": (116.83, None),
    "gpt-oss-20b": (20.91, None),
    # the Hugging Face pages' safetensors counts: 7.3B (the name says 7B) and 1B
    "Olmo-3-1025-7B": (7.3, None),
    "gemma-3-1b-it": (1.0, None),
    # Qwen's cards: 80B; 27B and 35B counting the vision encoder, which the text model
    # (our spec of a published Qwen3.5 config) lacks: ours 79.67B, 26.90B, 34.66B
    "Qwen3-Next-80B-A3B-Instruct": (80.0, None),
    "Qwen3.5-27B": (27.0, None),
    "Qwen3.5-35B-A3B": (35.0, None),
    # MiniMax's model card: "230 billion total parameters" (ours 228.7B)
    "MiniMax-M2": (230.0, None),
    # the Hugging Face pages' safetensors counts: 13.7B and 1.48B
    "OLMo-2-1124-13B": (13.7, None),
    "OLMo-2-0425-1B": (1.48, None),
}

#: Wider bands where the vendor's figure counts differently: Z.ai's 355B / 106B round
#: the main model and its multi-token-prediction layer their own way (ours, the main
#: model's canonical tensors: 352.8B and 106.9B). Moonshot's card gives Kimi-K2 as "1T"
#: (one significant figure; ours: 1026.4B, equal to transformers' count on the meta
#: device, tests/oracles/test_model_specs_hf.py).
TOLERANCE = {
    "GLM-4.5": 0.01,
    "GLM-4.5-Air": 0.01,
    "Kimi-K2-Instruct": 0.03,
    "Qwen3.5-35B-A3B": 0.01,
    "MiniMax-M2": 0.01,  # the card's "230B" has two significant figures
}

#: Published active parameters per token (billions), as the model cards round them.
PUBLISHED_ACTIVE = {
    "Qwen3-30B-A3B": 3.3,
    "Qwen3-235B-A22B": 22.0,
    "Mixtral-8x7B-v0.1": 12.9,
    "Mixtral-8x22B-v0.1": 39.0,
    "GLM-4.5": 32.0,
    "GLM-4.5-Air": 12.0,
    "DeepSeek-V3": 37.0,
    "GLM-5": 40.0,
    "Kimi-K2-Instruct": 32.0,
    "gpt-oss-120b": 5.13,
    "gpt-oss-20b": 3.61,
    # NVIDIA's model card of Qwen3-Next-80B-A3B: 3.9B active; Qwen's Qwen3.5-35B-A3B: "3B"
    "Qwen3-Next-80B-A3B-Instruct": 3.9,
    "Qwen3.5-35B-A3B": 3.0,
    "MiniMax-M2": 10.0,
}

#: Active-count bands wider than 2%: Kimi-K2's card gives "32B activated" (ours 32.86B).
ACTIVE_TOLERANCE = {"Kimi-K2-Instruct": 0.03, "Qwen3.5-35B-A3B": 0.15}  # "3B": ours 3.45B

#: Model cards whose active count leaves out the embedding and output layer.
ACTIVE_WITHOUT_EMBEDDINGS = ("GLM-4.5", "GLM-4.5-Air", "MiniMax-M2")

#: Model cards whose active count leaves out the embedding only (OpenAI's gpt-oss card
#: counts the unembedding: 5.13B and 3.61B active).
ACTIVE_WITHOUT_EMBEDDING_TABLE = ("gpt-oss-120b", "gpt-oss-20b")


#: Published totals that count the multi-token-prediction layers (read with ``mtp=True``).
MTP_COUNTED = ("DeepSeek-V3.2-Exp",)

#: MoE configs with no published active count (DeepSeek-V3.2-Exp's card gives none).
NO_ACTIVE_FIGURE = ("DeepSeek-V3.2-Exp",)

#: Z.ai's GLM-5 card counts its 40B active parameters without the embedding and output.
ACTIVE_WITHOUT_EMBEDDINGS += ("GLM-5",)


def test_every_published_config_is_present() -> None:
    assert sorted(p.stem for p in SPECS.glob("*.json")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name: str) -> None:
    spec = model_from_hf_config(SPECS / f"{name}.json", mtp=name in MTP_COUNTED)
    billions, exact = PUBLISHED[name]
    # the published figures are rounded (0.49, 7.6, ...); without an exact count, 0.5%
    tol = TOLERANCE.get(name, 0.01 if exact else 0.005)
    assert math.isclose(spec.num_params, billions * 1e9, rel_tol=tol)
    assert exact is None or spec.num_params == exact


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_active_parameter_counts(name: str) -> None:
    """Dense models use every parameter; MoE models match the model cards, which round
    to two significant figures (hence 2%)."""
    spec = model_from_hf_config(SPECS / f"{name}.json")
    if name in NO_ACTIVE_FIGURE:
        return
    if not spec.is_moe:
        assert spec.num_active_params == spec.num_params
        return
    active = spec.num_active_params
    if name in ACTIVE_WITHOUT_EMBEDDINGS:
        vocab = spec.tensor("model.embed_tokens.weight").numel
        active -= vocab * (1 if spec.tie_word_embeddings else 2)
    if name in ACTIVE_WITHOUT_EMBEDDING_TABLE:
        active -= spec.tensor("model.embed_tokens.weight").numel
    tol = ACTIVE_TOLERANCE.get(name, 0.02)
    assert math.isclose(active, PUBLISHED_ACTIVE[name] * 1e9, rel_tol=tol)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_specs_repr_round_trip(name: str) -> None:
    spec = model_from_hf_config(SPECS / f"{name}.json")
    assert eval(repr(spec)) == spec
    assert model_from_hf_config(spec.hf_config()) == spec


def test_published_architecture_facts() -> None:
    q05 = model_from_hf_config(SPECS / "Qwen2.5-0.5B.json")
    assert q05.tie_word_embeddings and q05.qkv_bias and not q05.o_bias
    assert q05.tensor("model.layers.0.self_attn.k_proj.bias").shape == (128,)
    moe = model_from_hf_config(SPECS / "Qwen3-30B-A3B.json")
    assert moe.moe_layers == (True,) * 48 and moe.num_experts == 128
    assert moe.tensor("model.layers.47.mlp.experts.127.down_proj.weight").shape == (2048, 768)
    assert moe.tensor("model.layers.0.mlp.gate.weight").shape == (128, 2048)
    llama = model_from_hf_config(SPECS / "Llama-3.1-8B.json")
    assert dict(llama.rope_scaling)["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    assert llama.tensors[-1].name == "lm_head.weight"
    assert model_from_hf_config(SPECS / "Llama-3.2-1B.json").head_dim == 64


def test_gpt_oss_published_facts() -> None:
    """gpt-oss-120b as its config.json says: alternating 128-token windows from layer 0,
    yarn rope, fused experts with biases, a biased router, sinks per head."""
    spec = model_from_hf_config(SPECS / "gpt-oss-120b.json")
    assert spec.sliding_window == 128 and spec.sliding_layers == (True, False) * 18
    assert dict(spec.rope_scaling)["rope_type"] == "yarn" and spec.rope_theta == 150000.0
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 7.0)
    assert spec.num_experts == 128 and spec.num_experts_per_tok == 4 and spec.qkv_bias
    layer = {t.name.split(".", 3)[3]: t.shape for t in spec.layer_tensors(35)}
    assert layer["self_attn.sinks"] == (64,)
    assert layer["mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert layer["mlp.experts.gate_up_proj_bias"] == (128, 5760)
    assert layer["mlp.experts.down_proj"] == (128, 2880, 2880)
    assert layer["mlp.router.bias"] == (128,)
    small = model_from_hf_config(SPECS / "gpt-oss-20b.json")
    assert small.num_experts == 32 and small.num_layers == 24


def test_olmo3_and_gemma3_published_facts() -> None:
    """Olmo-3-1025-7B: a 4096-token window on three layers of four, YaRN (full-attention
    layers only), q/k norms over the whole projections, post-norms and no input norm.
    gemma-3-1b-it: a 512-token window on five layers of six, local base 10000, four
    norms per layer, per-head q/k norms, tied embeddings."""
    olmo = model_from_hf_config(SPECS / "Olmo-3-1025-7B.json")
    assert olmo.sliding_window == 4096 and olmo.sliding_layers == (True, True, True, False) * 8
    assert dict(olmo.rope_scaling)["rope_type"] == "yarn" and olmo.rope_local_theta is None
    layer = {t.name.split(".", 3)[3]: t.shape for t in olmo.layer_tensors(0)}
    assert layer["self_attn.q_norm.weight"] == layer["self_attn.k_norm.weight"] == (4096,)
    assert "input_layernorm.weight" not in layer
    assert layer["post_feedforward_layernorm.weight"] == (4096,)
    gemma = model_from_hf_config(SPECS / "gemma-3-1b-it.json")
    assert gemma.sliding_window == 512 and gemma.sliding_layers == ((True,) * 5 + (False,)) * 4 + (
        True,
        True,
    )
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4) and gemma.rope_scaling == ()
    assert gemma.query_pre_attn_scalar == 256 and gemma.tie_word_embeddings
    layer = {t.name.split(".", 3)[3]: t.shape for t in gemma.layer_tensors(25)}
    assert layer["self_attn.q_norm.weight"] == (256,)
    assert sum(n.endswith("layernorm.weight") for n in layer) == 4


@given(cfg=hf_configs("gpt_oss").flatmap(gpt_oss_layer_types))
def test_gpt_oss_sliding_layers_follow_layer_types(cfg: dict[str, object]) -> None:
    spec = model_from_hf_config(cfg)
    marked = tuple(k == "sliding_attention" for k in cfg["layer_types"])  # type: ignore[attr-defined]
    assert spec.sliding_layers == marked
    assert spec.sliding_window == cfg.get("sliding_window", 128)
    assert model_from_hf_config(spec.hf_config()) == spec


def test_path_dir_and_dict_agree(tmp_path: Path) -> None:
    src = SPECS / "Qwen3-8B.json"
    (tmp_path / "config.json").write_text(src.read_text())
    assert model_from_hf_config(tmp_path) == model_from_hf_config(src)
    assert model_from_hf_config(str(src)) == model_from_hf_config(load_hf_config(src))


_TINY = {
    "model_type": "qwen2",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
}

#: Settings of the keys refused when they change the computation, in the forms that do not.
ACCEPTED = {
    "silu": {"hidden_act": "silu"},
    "Qwen2.5 window off": {"use_sliding_window": False, "sliding_window": 131072},
    "window on, no layer past max_window_layers": {
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 2,
    },
    "window on but null": {"use_sliding_window": True, "sliding_window": None},
    "transformers 5 layer_types": {
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
    },
    "sliding layer_types, window off": {"layer_types": ["full_attention", "sliding_attention"]},
    "full rotary": {"partial_rotary_factor": 1.0},
    "yarn": {"rope_scaling": {"type": "yarn", "factor": 4.0}},
    "default rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "token ids and versions": {
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "transformers_version": "4.51.0",
        "use_mrope": False,
    },
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_keys_that_change_no_computation_are_accepted(name: str) -> None:
    spec = model_from_hf_config({**_TINY, **ACCEPTED[name]})
    plain = model_from_hf_config(_TINY)
    assert spec.tensors == plain.tensors
    assert attrs.evolve(spec, rope_scaling=()) == plain


def test_llama_without_a_window_is_accepted() -> None:
    llama = {**_TINY, "model_type": "llama"}
    assert model_from_hf_config({**llama, "sliding_window": None}) == model_from_hf_config(llama)


def test_tensor_spec_repr_round_trip() -> None:
    t = TensorSpec(name="model.norm.weight", shape=(8,), dtype="bfloat16")
    assert eval(repr(t)) == t


@given(spec=model_specs())
def test_repr_round_trip(spec: ModelSpec) -> None:
    assert eval(repr(spec)) == spec
    assert hash(eval(repr(spec))) == hash(spec)


@given(cfg=hf_configs())
def test_deterministic_and_json_stable(cfg: dict[str, object]) -> None:
    a = model_from_hf_config(cfg)
    b = model_from_hf_config(json.loads(json.dumps(copy.deepcopy(cfg))))
    assert a == b and a.tensors == b.tensors


@given(spec=model_specs())
def test_hf_config_round_trip(spec: ModelSpec) -> None:
    assert model_from_hf_config(spec.hf_config()) == spec
    assert model_from_hf_config(json.loads(json.dumps(spec.hf_config()))) == spec


@given(spec=model_specs())
def test_tensor_laws(spec: ModelSpec) -> None:
    names = spec.tensor_names
    assert len(set(names)) == len(names)
    assert spec.num_params == sum(math.prod(t.shape) for t in spec.tensors)
    own = {  # tensors the family keeps in a dtype of their own (GLM's float32 router)
        r.name: r.dtype for r in spec.family.canonical if r.dtype is not None
    }
    for t in spec.tensors:
        rel = t.name.split(".", 3)[-1] if t.name.startswith("model.layers.") else t.name
        assert t.dtype == own.get(rel, spec.dtype), t.name
    assert ("lm_head.weight" in names) == (not spec.tie_word_embeddings)
    assert names[0] == "model.embed_tokens.weight"
    tail = (
        ("model.norm.weight",)
        if spec.tie_word_embeddings
        else ("model.norm.weight", "lm_head.weight")
    )
    assert names[-len(tail) :] == tail
    layers = [t.name for i in range(spec.num_layers) for t in spec.layer_tensors(i)]
    assert list(names) == [names[0], *layers, *tail]
    for t in spec.tensors:
        assert spec.tensor(t.name) is t
    for i in range(spec.num_layers):
        has_experts = any(".experts." in t.name for t in spec.layer_tensors(i))
        assert spec.is_moe_layer(i) == has_experts


@given(spec=model_specs())
def test_moe_tensor_counts(spec: ModelSpec) -> None:
    for i in range(spec.num_layers):
        experts = [t for t in spec.layer_tensors(i) if ".experts." in t.name]
        # gpt-oss stores its experts as four stacked tensors [E, ...]; the others per expert
        per_layer = 4 if spec.model_type == "gpt_oss" else 3 * spec.num_experts
        assert len(experts) == (per_layer if spec.is_moe_layer(i) else 0)
        if spec.model_type == "gpt_oss" and spec.is_moe_layer(i):
            assert all(t.shape[0] == spec.num_experts for t in experts)


@given(spec=model_specs())
def test_memory_view_tiles_memory_and_covers_canonical_once(spec: ModelSpec) -> None:
    view = hf_memory_view(spec)
    assert len({m.name for m in view}) == len(view)
    covered: dict[str, int] = {}
    for m in view:
        whole = Box.full(m.shape)
        assert sum(p.memory_box.numel for p in m.pieces) == whole.numel
        for a_i, a in enumerate(m.pieces):
            assert whole.contains(a.memory_box)
            assert a.canonical_box == Box.full(spec.tensor(a.canonical).shape)
            for b in m.pieces[a_i + 1 :]:
                assert a.memory_box.intersect(b.memory_box) is None
            covered[a.canonical] = covered.get(a.canonical, 0) + 1
    assert sorted(covered) == sorted(spec.tensor_names)
    aliases = {"model.embed_tokens.weight": 2} if spec.tie_word_embeddings else {}
    assert covered == {n: aliases.get(n, 1) for n in spec.tensor_names}
    fused = [m for m in view if m.is_fused]
    moe_layers = sum(spec.moe_layers)
    renamed = {old for old, _new in spec.family.memory_names}
    moved = sum(t.name.split(".", 3)[-1] in renamed for t in spec.tensors)
    groups = len(spec.family.fused_experts)  # gpt-oss: none, memory holds the checkpoint's
    assert len(fused) == groups * moe_layers + moved + spec.tie_word_embeddings


def _megatron_reference(vocab: int, divisible_by: int, tp: int) -> int:
    after, multiple = vocab, divisible_by * tp
    while after % multiple:
        after += 1
    return after


@settings(max_examples=200)
@given(
    vocab=st.integers(1, 300_000), tp=st.integers(1, 64), d=st.sampled_from([1, 8, 64, 128, 256])
)
def test_padded_vocab_matches_megatron(vocab: int, tp: int, d: int) -> None:
    padded = padded_vocab_size(vocab, tp=tp, divisible_by=d)
    assert padded == _megatron_reference(vocab, d, tp)
    assert padded % (d * tp) == 0 and 0 <= padded - vocab < d * tp
    assert padded_vocab_size(padded, tp=tp, divisible_by=d) == padded
    assert vocab_padding(vocab, tp=tp, divisible_by=d) == padded - vocab


def test_padded_vocab_examples() -> None:
    assert padded_vocab_size(151936, tp=1) == 151936
    assert padded_vocab_size(151936, tp=8) == 152576
    assert padded_vocab_size(152064, tp=8) == 152576
    assert padded_vocab_size(128256, tp=8) == 129024


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_strategy_covers_each_family(family: str) -> None:
    @settings(max_examples=5)
    @given(spec=model_specs(family))
    def check(spec: ModelSpec) -> None:
        assert spec.model_type == family

    check()
