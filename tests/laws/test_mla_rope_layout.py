"""Multi-latent attention with ``rope_interleave=false`` under Megatron layouts.

Megatron-Core's MLA de-interleaves each rope block (``cat(x[0::2], x[1::2])``) before it
rotates the halves; transformers with ``rope_interleave=false`` rotates the halves as
they are. The layout lays the rope rows of the q and kv_a projections interleaved, so
Megatron's de-interleave gives back transformers' order: checked here on the tensors
``to_megatron`` writes (against ``torch.stack`` of the two halves), and by a bitwise
round trip through every strategy. (Logits: tests/distributed/conversion_worker.py.)
"""

import pytest
import torch

from areal_fn import megatron_layout, model_from_hf_config
from areal_fn.plans.convert import to_hf, to_megatron

_CFG: dict[str, object] = {
    "model_type": "deepseek_v3",
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 6,
    "q_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 6,
    "v_head_dim": 4,
    "vocab_size": 32,
    "rope_interleave": False,
}


def _state(spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def _interleaved(rope: torch.Tensor) -> torch.Tensor:
    """Rows ``[r_0, r_{n/2}, r_1, r_{n/2+1}, ...]`` of ``rope`` (an independent statement
    of the permutation: stack the two halves, rows alternate)."""
    half = rope.shape[0] // 2
    return torch.stack([rope[:half], rope[half:]], dim=1).reshape(rope.shape)


@pytest.mark.parametrize("q_lora", [8, None])
def test_megatron_rope_rows_are_interleaved(q_lora: int | None) -> None:
    spec = model_from_hf_config({**_CFG, "q_lora_rank": q_lora})
    sd = _state(spec)
    local = to_megatron(sd, megatron_layout(spec, "megatron:t1"), 0)
    nope, rope, heads = 4, 6, 4
    q_name = "q_b_proj" if q_lora else "q_proj"
    q_local = "linear_q_up_proj" if q_lora else "linear_q_proj"
    hf_q = sd[f"model.layers.0.self_attn.{q_name}.weight"].view(heads, nope + rope, -1)
    meg_q = local[f"decoder.layers.0.self_attention.{q_local}.weight"].view(heads, nope + rope, -1)
    assert torch.equal(meg_q[:, :nope], hf_q[:, :nope])
    for h in range(heads):
        assert torch.equal(meg_q[h, nope:], _interleaved(hf_q[h, nope:]))
    hf_kv = sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    meg_kv = local["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    assert torch.equal(meg_kv[:6], hf_kv[:6])
    assert torch.equal(meg_kv[6:], _interleaved(hf_kv[6:]))
    assert not torch.equal(meg_kv, hf_kv)  # the law above is not the identity


def test_rope_interleave_true_copies_whole() -> None:
    spec = model_from_hf_config({**_CFG, "rope_interleave": True})
    sd = _state(spec)
    local = to_megatron(sd, megatron_layout(spec, "megatron:t1"), 0)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert torch.equal(
        local["decoder.layers.0.self_attention.linear_kv_down_proj.weight"], sd[name]
    )


@pytest.mark.parametrize(
    "strategy", ["megatron:t1", "megatron:t2", "megatron:t4", "megatron:p2", "megatron:t2e2"]
)
@pytest.mark.parametrize("q_lora", [8, None])
def test_round_trip_is_bitwise(strategy: str, q_lora: int | None) -> None:
    spec = model_from_hf_config({**_CFG, "q_lora_rank": q_lora})
    sd = _state(spec)
    layout = megatron_layout(spec, strategy)
    states = {r: to_megatron(sd, layout, r) for r in range(layout.world_size)}
    back = to_hf(states, layout, check_replicas=True)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
