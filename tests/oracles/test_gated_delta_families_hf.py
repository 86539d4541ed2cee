"""Oracle: the gated-delta-net families (Qwen3-Next, Qwen3.5 dense and MoE) against the
models transformers builds and the files its ``save_pretrained`` writes.

Facts pinned here (transformers 5): a ``linear_attention`` layer holds ``linear_attn``
(``dt_bias``, ``A_log``, ``conv1d``, Qwen3-Next's fused ``in_proj_qkvz``/``in_proj_ba``
or Qwen3.5's ``in_proj_qkv``/``_z``/``_b``/``_a``, ``norm``, ``out_proj``) and no
``self_attn``; a ``full_attention`` layer's ``q_proj`` is ``2 * heads * head_dim`` wide;
the MoE block is router, experts, ``shared_expert``, ``shared_expert_gate``;
``save_pretrained`` writes experts one tensor per expert; a published Qwen3.5 config's
``text_config`` builds the text model. End to end: a tiny model's files read into FSDP2
and inference layouts, exported back and loaded by ``from_pretrained``; the cache and
FLOPs the cost models count, against transformers' cache and torch's flop counter.
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.errors import SpecError, UnsupportedConfigError
from areal_fn.model.linear_attention import is_linear_layer
from areal_fn.model.spec import model_from_hf_config
from areal_fn.testing.models import hf_configs
from tests.oracles.test_model_specs_hf import _build, _check_model

pytest.importorskip("transformers")

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
_LINEAR = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _cfg(model_type: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "model_type": model_type,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 40,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 6,
        "linear_conv_kernel_dim": 3,
        "torch_dtype": "float32",
    }
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


_MOE = {
    "num_experts": 3,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 10,
}

CASES = {
    "qwen3_next": _cfg("qwen3_next", **_MOE),
    "qwen3_next-sparse2-mlp-only-layer-types-bf16": _cfg(
        "qwen3_next",
        num_hidden_layers=5,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
        layer_types=["full_attention", "linear_attention", "linear_attention"]
        + ["full_attention"] * 2,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **_MOE,
    ),
    "qwen3_5_text": _cfg("qwen3_5_text", full_attention_interval=2),
    "qwen3_5_text-tied-half-rotary": _cfg(
        "qwen3_5_text", partial_rotary_factor=0.5, tie_word_embeddings=True, linear_num_key_heads=1
    ),
    "qwen3_5_moe_text": _cfg("qwen3_5_moe_text", intermediate_size=None, **_MOE),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_spec_matches_transformers_and_save_pretrained(name: str, tmp_path: Path) -> None:
    _check_model(CASES[name], tmp_path)


def _kinds(model: Any) -> tuple[tuple[bool, bool], ...]:
    """Per layer: (linear attention, routed experts), as transformers built them."""
    return tuple(
        (
            hasattr(layer, "linear_attn") and not hasattr(layer, "self_attn"),
            type(layer.mlp).__name__.endswith("SparseMoeBlock"),
        )
        for layer in model.model.layers
    )


@settings(max_examples=15, deadline=None)
@given(cfg=st.sampled_from(_LINEAR).flatmap(lambda f: hf_configs(f, max_layers=5)))
def test_layer_kinds_and_hf_config_match_transformers(cfg: dict[str, object]) -> None:
    """Which layers are linear attention and which have experts, in the model transformers
    builds from the config and from ``hf_config()``; the rotated dims of each head."""
    spec = model_from_hf_config(cfg)
    want = tuple((is_linear_layer(spec, i), spec.moe_layers[i]) for i in range(spec.num_layers))
    for built in (_build(cfg, meta=True), _build(spec.hf_config(), meta=True)):
        assert _kinds(built) == want
        rotated = built.model.rotary_emb.inv_freq.numel() * 2
        assert rotated == int(spec.head_dim * spec.rotary_fraction)


@pytest.mark.parametrize("name", ["Qwen3.5-27B", "Qwen3.5-35B-A3B"])
def test_published_qwen3_5_reads_its_text_config(name: str) -> None:
    """The published multimodal config is read as its text model: the spec equals the
    one read from ``text_config`` alone, and the multimodal rope keys are dropped."""
    import json

    cfg = json.loads((SPECS / f"{name}.json").read_text())
    spec = model_from_hf_config(cfg)
    assert spec == model_from_hf_config(cfg["text_config"])
    assert spec.model_type == cfg["text_config"]["model_type"]
    assert spec.rope_scaling == () and spec.rotary_fraction == 0.25
    assert model_from_hf_config(spec.hf_config()) == spec


@pytest.mark.parametrize(
    ("cfg", "err", "match"),
    [
        (
            _cfg("qwen3_5_text", layer_types=["linear_attention", "sliding_attention"] * 2),
            UnsupportedConfigError,
            r"qwen3_5_text config has layer_types\[1\]='sliding_attention'; the qwen3_5_text "
            r"family models \['full_attention', 'linear_attention'\] layers only",
        ),
        (
            _cfg("qwen3_5_text", layer_types=["full_attention"] * 4, full_attention_interval=4),
            SpecError,
            r"qwen3_5_text config gives layer_types and full_attention_interval=4, which disagree",
        ),
        (
            _cfg("qwen3_5_text", linear_num_value_heads=3),
            SpecError,
            r"value_heads=3 is not a multiple of key_heads=2",
        ),
        (
            _cfg("qwen3_5_moe_text", **_MOE),
            UnsupportedConfigError,
            r"qwen3_5_moe_text config sets intermediate_size=24, which transformers' "
            r"qwen3_5_moe_text config class does not have",
        ),
        (
            _cfg("qwen3_next", num_local_experts=3, **{**_MOE, "num_experts": None}),
            UnsupportedConfigError,
            r"qwen3_next config sets num_local_experts=3",
        ),
        (
            {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_moe_text"}},
            SpecError,
            r"model_type='qwen3_5', a multimodal model whose text model is read from "
            r"text_config \(model_type 'qwen3_5_text'\)",
        ),
        (
            {
                "model_type": "qwen3_5",
                "tie_word_embeddings": True,
                "text_config": _cfg("qwen3_5_text", tie_word_embeddings=False),
            },
            SpecError,
            r"tie_word_embeddings=True and text_config.tie_word_embeddings=False; they must agree",
        ),
    ],
)
def test_refusals(cfg: dict[str, object], err: type[Exception], match: str) -> None:
    with pytest.raises(err, match=match):
        model_from_hf_config(cfg)


def test_kv_cache_counts_what_transformers_caches() -> None:
    """After a forward of n tokens, transformers' cache holds per full-attention layer
    n tokens of keys and values, and per linear-attention layer a state independent of n:
    the recurrent matrices and the conv window, which transformers keeps ``conv_kernel``
    inputs wide and the engines (vLLM) ``conv_kernel - 1``. ``kv_cache`` at tp=1 counts
    the same elements (the conv one column narrower per channel)."""
    from areal_fn.plans.memory.kv_cache import kv_cache

    cfg = CASES["qwen3_next"]
    spec = model_from_hf_config(cfg)
    model = _build(cfg).eval()
    for n in (5, 11):
        with torch.no_grad():
            out = model(input_ids=torch.arange(n)[None] % 40, use_cache=True)
        per_token = conv = recurrent = 0
        for layer in out.past_key_values.layers:
            if hasattr(layer, "keys"):
                per_token += (layer.keys.numel() + layer.values.numel()) // n
            else:
                conv += sum(c.numel() for c in layer.conv_states.values())
                recurrent += sum(r.numel() for r in layer.recurrent_states.values())
        la = spec.linear_attention
        assert la is not None
        linear = sum(la.layers)
        kv = kv_cache(spec, "sglang:d1", context_len=n, dtype="float32")
        assert kv.elements_per_token_layer * (spec.num_layers - linear) == per_token
        narrower = linear * (2 * la.key_dim + la.value_dim)  # one conv input per channel
        assert kv.linear_state_elements * linear == conv - narrower + recurrent
        assert kv.max_bytes == 4 * (n * per_token + conv - narrower + recurrent)


def test_linear_attention_flops_match_torch_flop_counter() -> None:
    """``flop_costs``'s linear-attention layer against ``torch.utils.flop_counter`` on
    transformers' module: its projections (``aten.mm``) exactly; its conv, which torch
    counts over the ``conv_kernel - 1`` padded outputs transformers drops, per useful
    output; plus the recurrent delta rule's ``3 * key_head_dim * value_head_dim`` products
    per value head and token (transformers' chunked torch form spends more, in ``bmm``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from areal_fn.pipeline.costs import flop_costs

    cfg = CASES["qwen3_5_text"]
    spec = model_from_hf_config(cfg)
    la = spec.linear_attention
    assert la is not None
    module = _build(cfg).model.layers[0].linear_attn
    for n in (7, 12):
        x = torch.randn(1, n, spec.hidden_size, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            module(x)
        ops = {str(op): f for op, f in counter.get_flop_counts()["Global"].items()}
        conv = ops["aten.convolution"] * n // (n + la.conv_kernel - 1)
        rule = 2 * 3 * la.value_heads * la.key_head_dim * la.value_head_dim * n
        costs = flop_costs(spec, seq_len=n)
        mlp = 2 * 3 * spec.hidden_size * spec.intermediate_size * n  # the dense SwiGLU
        assert costs.layers[0] == 3.0 * (ops["aten.mm"] + conv + rule + mlp)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text-tied-half-rotary"])
def test_files_to_layouts_and_back_to_a_loadable_checkpoint(tmp_path: Path, name: str) -> None:
    """A tiny model saved by ``save_pretrained``, read from its files into an FSDP2
    (d2t2, or d2 with one key head) and an inference (sglang t2, or d2) layout, gathered
    back, exported with
    ``write_hf_checkpoint`` and loaded by ``from_pretrained``: the same tensors bitwise
    and the same logits; ``hf_config()`` alone builds the same computation."""
    import transformers

    from areal_fn import fsdp2_layout, inference_layout
    from areal_fn.model.hf_memory import hf_state_to_canonical
    from areal_fn.plans.convert import to_hf, to_megatron
    from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint

    model = _build(CASES[name])
    with torch.no_grad():  # (1 + w) norms and the delta rule's parameters: give values
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    spec = model_from_hf_config(tmp_path / "hf")
    assert spec == model_from_hf_config(CASES[name])
    ref = model.state_dict()
    canon = hf_state_to_canonical(ref, spec)
    with HfCheckpoint(tmp_path / "hf") as ckpt:
        ckpt.check(spec)
        # tp splits whole key-head groups: one key head (the tied case) serves replicas
        t = 2 if spec.linear_attention.key_heads % 2 == 0 else 1  # type: ignore[union-attr]
        for layout in (
            fsdp2_layout(spec, f"fsdp:d2t{t}"),
            inference_layout(spec, f"sglang:d{3 - t}t{t}"),
        ):
            states = {r: to_megatron(ckpt.read, layout, r) for r in range(layout.world_size)}
            back = to_hf(states, layout, check_replicas=True)
            assert back.keys() == canon.keys()
            assert all(torch.equal(back[k], canon[k]) for k in canon)
    out = write_hf_checkpoint(tmp_path / "out", back, model=spec, max_shard_bytes=30_000)
    assert model_from_hf_config(out) == spec
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = loaded.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 8, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
        again = _build(spec.hf_config())
        again.load_state_dict(ref, strict=True)
        assert torch.equal(model(ids).logits, again(ids).logits)
