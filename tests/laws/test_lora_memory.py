"""Laws of LoRA training memory (areal_fn.plans.memory.lora).

Expected bytes are computed here from the published config's fields alone: the base's
elements from its layer shapes, the adapters' as ``r * (in + out)`` per targeted module,
with bf16 weights, fp32 gradients, fp32 master weights, fp32 Adam moments and Adam's
4-byte ``step`` per adapter tensor.
"""

import json
from pathlib import Path

import pytest

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lora import adapter_layout
from areal_fn.model.lora import LoraConfig, default_targets
from areal_fn.model.spec import load_hf_config, model_from_hf_config
from areal_fn.plans.advisor import suggest_strategy
from areal_fn.plans.advisor.census import census_of
from areal_fn.plans.memory import ActivationModel, PrecisionPolicy, estimate_memory
from areal_fn.plans.memory.lora import estimate_lora_memory, lora_adapter_census
from areal_fn.strategy.allocation import Backend

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
GB80 = 80 * 10**9


def _qwen3_8b_counts(r: int) -> tuple[int, int, int]:
    """(base elements, adapter elements, adapter tensors) of Qwen3-8B, from its config."""
    c = json.loads((SPECS / "Qwen3-8B.json").read_text())
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    assert not c["tie_word_embeddings"] and not c["attention_bias"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * c["head_dim"]
    base = 2 * v * h + h + n * layer
    # q, k, v, o, gate, up, down: r * (in + out) each
    per_layer = r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return base, n * per_layer, 14 * n


def test_qwen3_8b_one_rank_bytes_from_the_shapes() -> None:
    model = model_from_hf_config(load_hf_config(SPECS / "Qwen3-8B.json"))
    config = LoraConfig(rank=32, target_modules=default_targets(model))
    base_n, lora_n, lora_t = _qwen3_8b_counts(32)
    layout = layout_for(model, "fsdp:d1")
    report = estimate_lora_memory(layout, adapter_layout(layout, model, config))
    (row,) = report.rows
    assert row.params == 2 * base_n + 2 * lora_n
    assert row.grads == 4 * lora_n
    assert row.optimizer == (4 + 8) * lora_n + 4 * lora_t
    full = estimate_memory(layout).rows[0]
    assert full.model_state > GB80 > row.model_state  # full fine-tuning does not fit; LoRA does


@pytest.mark.parametrize("component", ["fsdp:d4t2", "megatron:d2p2t2", "megatron:d4p2"])
def test_rows_are_frozen_base_plus_trained_adapters(component: str) -> None:
    model = model_from_hf_config(load_hf_config(SPECS / "Qwen3-8B.json"))
    config = LoraConfig(rank=16, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
    layout = layout_for(model, component)
    adapters = adapter_layout(layout, model, config)
    policy = PrecisionPolicy.bf16_mixed()
    report = estimate_lora_memory(layout, adapters, policy)
    base = estimate_memory(layout, policy)
    trained = estimate_memory(adapters, policy)
    for row, b, t in zip(report.rows, base.rows, trained.rows, strict=True):
        assert row.params == b.params + t.params
        assert (row.grads, row.optimizer) == (t.grads, t.optimizer)
        assert 0 < t.params < b.params // 50
    assert census_of(adapters) == lora_adapter_census(model, component, config)


def test_activations_as_for_the_base() -> None:
    model = model_from_hf_config(load_hf_config(SPECS / "Qwen3-8B.json"))
    config = LoraConfig(rank=8)
    layout = layout_for(model, "megatron:d2p2t2")
    act = ActivationModel(micro_batch_size=1, seq_len=4096, recompute=True)
    lora = estimate_lora_memory(
        layout,
        adapter_layout(layout, model, config),
        activation=act,
        model=model,
        dims="megatron:d2p2t2",
    )
    full = estimate_memory(layout, activation=act, model=model, dims="megatron:d2p2t2")
    assert [r.activations for r in lora.rows] == [r.activations for r in full.rows]
    assert all(a.total < b.total for a, b in zip(lora.rows, full.rows, strict=True))


def test_refusals() -> None:
    model = model_from_hf_config(load_hf_config(SPECS / "Qwen3-8B.json"))
    config = LoraConfig(rank=8)
    infer = layout_for(model, "sglang:t2")
    with pytest.raises(SpecError, match="an inference layout trains nothing"):
        estimate_lora_memory(infer, adapter_layout(infer, model, config))
    fsdp = layout_for(model, "fsdp:d2")
    other = adapter_layout(layout_for(model, "fsdp:d4"), model, config)
    with pytest.raises(
        SpecError, match="adapters' fsdp2 layout of 4 ranks is not the base's fsdp2 layout of 2"
    ):
        estimate_lora_memory(fsdp, other)


def test_advisor_suggests_lora_where_full_training_does_not_fit() -> None:
    model = model_from_hf_config(load_hf_config(SPECS / "Qwen3-8B.json"))
    act = ActivationModel(micro_batch_size=1, seq_len=2048, recompute=True)
    with pytest.raises(SpecError, match="no strategy"):
        suggest_strategy(model, 1, GB80, activation=act)
    config = LoraConfig(rank=32, target_modules=default_targets(model))
    found = suggest_strategy(model, 1, GB80, activation=act, lora=config, top=3)
    assert found and all(s.memory.max_total <= GB80 * 0.9 for s in found)
    base_n, lora_n, lora_t = _qwen3_8b_counts(32)
    for s in found:
        row = s.memory.rows[0]
        assert row.grads == 4 * lora_n
        # Megatron fuses q/k/v and gate/up: 8 adapter tensors a layer (Adam's step each), not 14
        tensors = lora_t if s.backend is Backend.FSDP else lora_t * 8 // 14
        if s.backend is Backend.FSDP:  # fp32 sharded parameters, AdamW on them: no master
            assert row.optimizer == 8 * lora_n + 4 * tensors
            assert row.params == 4 * base_n + 4 * lora_n
        else:  # bf16 parameters, fp32 master weights and Adam states
            assert row.optimizer == 12 * lora_n + 4 * tensors


def test_moe_megatron_tp_adapters_per_rank_from_the_shapes() -> None:
    """Qwen3-30B-A3B under megatron:d2p2t2e4: attention adapters only (a MoE family);
    per rank and layer ``r * (3h + (q + 2kv)/tp + q/tp + h)`` elements: lora_A of q/k/v
    whole, lora_B of q/k/v split by tp, lora_A of o_proj split by tp, its lora_B whole."""
    c = json.loads((SPECS / "Qwen3-30B-A3B.json").read_text())
    model = model_from_hf_config(c)
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    r, tp, pp = 16, 2, 2
    config = LoraConfig(rank=r, target_modules=default_targets(model))
    assert config.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    per_layer = r * (3 * h + (q + 2 * kv) // tp + q // tp + h)
    layout = layout_for(model, "megatron:d2p2t2e4")
    report = estimate_lora_memory(layout, adapter_layout(layout, model, config))
    base = estimate_memory(layout)
    for row, b in zip(report.rows, base.rows, strict=True):
        assert row.grads == 4 * per_layer * layers // pp
        assert row.params == b.params + 2 * per_layer * layers // pp
        # the distributed optimizer shards the adapters' 12 B/element over dp=2 (+ Adam's step,
        # 4 bytes for each of the 4 adapter tensors of a layer)
        assert row.optimizer == 12 * per_layer * layers // pp // 2 + 4 * 4 * layers // pp


@pytest.mark.parametrize(
    ("name", "component"),
    [
        ("Qwen3-8B", "megatron:d2p2t2"),
        ("Qwen3-8B", "megatron:d1p4t2v3"),
        ("Qwen3-30B-A3B", "megatron:d4p2t2e8"),
        ("DeepSeek-V3", "megatron:d8p8t4e32"),
        ("gpt-oss-20b", "megatron:d2p2t2e4"),
        ("GLM-4.5-Air", "megatron:p2t4e4"),
    ],
)
def test_megatron_adapter_census_equals_the_layouts(name: str, component: str) -> None:
    model = model_from_hf_config(load_hf_config(SPECS / f"{name}.json"))
    config = LoraConfig(rank=8, target_modules=default_targets(model))
    want = census_of(adapter_layout(layout_for(model, component), model, config))
    assert lora_adapter_census(model, component, config) == want


def test_megatron_adapter_census_refuses_as_the_layout_does() -> None:
    model = model_from_hf_config(load_hf_config(SPECS / "Qwen3-8B.json"))
    config = LoraConfig(rank=8, target_modules=("q_proj", "v_proj"))
    with pytest.raises(LayoutError, match=r"linear_qkv.weight fuses .*target all of its modules"):
        adapter_layout(layout_for(model, "megatron:t2"), model, config)
    with pytest.raises(LayoutError, match=r"linear_qkv.weight fuses .*target all of its modules"):
        lora_adapter_census(model, "megatron:t2", config)
