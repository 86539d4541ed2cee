"""Laws of LoRA adapters as canonical tensors (areal_fn.model.lora, areal_fn.layouts.lora).

- Round trip: canonical base + adapter tensors -> every rank of every layout kind
  (FSDP2 with TP and HSDP, Megatron with TP and PP, the inference engines, vLLM) ->
  back is bitwise, for one tiny model of each family.
- Placements follow the base layer: column-parallel bases split ``lora_B``'s rows like
  theirs and replicate ``lora_A``; row-parallel bases split ``lora_A``'s columns like
  theirs and replicate ``lora_B``; FSDP2 shards both on dim 0. On every rank the rows of
  ``lora_B`` a rank holds are the rows of the base weight it holds, and each row of a
  fused ``lora_B`` reads the member (q/k/v, gate/up) its base row belongs to.
- Shapes: ``r * (in + out)`` per target; refusals name the module and the rule.
- Transfer plans between LoRA layouts reproduce the destination (bytes at the lower
  bound); checkpoint plans write every adapter element once.
"""

import pytest
import torch

from areal_fn.errors import LayoutError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.layouts.lora import adapter_layout, adapter_row_members, with_lora
from areal_fn.layouts.vllm import vllm_layout
from areal_fn.model.lora import (
    LoraConfig,
    LoraError,
    default_targets,
    lora_param_count,
    lora_tensors,
)
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.convert import to_hf, to_megatron
from areal_fn.sharding.placement import Replicate, Shard, StridedShard


def _cfg(model_type: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "model_type": model_type,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 40,
        "torch_dtype": "float32",
    }
    base.update(kw)
    return base


#: One tiny model per family.
FAMILY_CONFIGS = {
    "qwen2": _cfg("qwen2"),
    "qwen3": _cfg("qwen3", head_dim=6, tie_word_embeddings=True),
    "llama": _cfg("llama", attention_bias=True, mlp_bias=True, torch_dtype="bfloat16"),
    "mistral": _cfg("mistral", sliding_window=None),
    "mixtral": _cfg("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": _cfg(
        "qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    ),
    "glm4_moe": _cfg(
        "glm4_moe",
        head_dim=8,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        attention_bias=True,
    ),
    "deepseek_v3": _cfg(
        "deepseek_v3",
        num_key_value_heads=4,
        q_lora_rank=6,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=3,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "gpt_oss": _cfg(
        "gpt_oss",
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "olmo3": _cfg("olmo3", sliding_window=3, attention_bias=True),
    "olmo2": _cfg("olmo2", attention_bias=True),
    "gemma3_text": _cfg(
        "gemma3_text", num_hidden_layers=3, head_dim=8, sliding_window=3, query_pre_attn_scalar=6
    ),
}

_COMPONENTS = (
    "fsdp:d2t2",
    "fsdp:d2x2",
    "fsdp:d3",
    "megatron:d1p2t2",
    "megatron:d2t2",
    "sglang:d1t2",
)


def _model(name: str) -> ModelSpec:
    return model_from_hf_config(FAMILY_CONFIGS[name])


def _layouts(model: ModelSpec) -> list[Layout]:
    """The base layouts of ``_COMPONENTS`` the family takes (olmo3 and gemma3_text have no
    Megatron layout; olmo3's whole-projection q/k norms refuse FSDP2's TP), at least 3."""
    out = []
    for c in _COMPONENTS:
        try:
            out.append(layout_for(model, c))
        except LayoutError:
            refused = model.family.megatron_refusal or model.family.fsdp2_tp_refusal
            assert refused, (model.model_type, c)
    assert len(out) >= 3
    if model.model_type in ("qwen2", "qwen3", "llama", "mistral"):
        out.append(vllm_layout(model, "vllm:t2"))
    return out


def _config(model: ModelSpec) -> LoraConfig:
    return LoraConfig(rank=3, alpha=8, target_modules=default_targets(model))


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_round_trip_every_layout_kind_is_bitwise(name: str) -> None:
    model = _model(name)
    config = _config(model)
    g = torch.Generator().manual_seed(1)
    for base in _layouts(model):
        layout = with_lora(base, model, config)
        assert layout.canonical == model.tensors + lora_tensors(model, config)
        src = {
            s.name: torch.randn(s.shape, generator=g).to(torch_dtype(s.dtype))
            for s in layout.canonical
        }
        states = {r: to_megatron(src, layout, r) for r in range(layout.world_size)}
        back = to_hf(states, layout, check_replicas=True)
        assert list(back) == [s.name for s in layout.canonical]
        for k, v in src.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), (name, base.kind, k)


def _rows(layout: Layout, rank: int, tensor: str) -> dict[str, set[tuple[int, int]]]:
    """Canonical name -> the row ranges of it that ``rank``'s ``tensor`` holds."""
    out: dict[str, set[tuple[int, int]]] = {}
    for lt in layout.local_tensors(rank):
        if lt.name == tensor:
            for p in lt.pieces:
                if p.canonical is not None and p.canonical_box is not None:
                    out.setdefault(p.canonical, set()).add(p.canonical_box.ranges[0])
    return out


def _peft(base: str) -> str:
    return "base_model.model." + base.removesuffix(".weight") + ".lora_B.weight"


@pytest.mark.parametrize(
    ("kv_heads", "component"),
    [(2, "fsdp:d2t2"), (4, "megatron:d1t4"), (2, "megatron:d2p2t2"), (2, "sglang:t4")],
)
def test_lora_b_rows_follow_the_base_rows_on_every_rank(kv_heads: int, component: str) -> None:
    model = model_from_hf_config(_cfg("qwen2", num_key_value_heads=kv_heads))
    base = layout_for(model, component)
    layout = with_lora(base, model, _config(model))
    checked = 0
    for t in base.tensors:
        b_name = t.name.removesuffix(".weight") + ".lora_B.weight"
        if b_name not in {x.name for x in layout.tensors}:
            continue
        for rank in range(layout.world_size):
            want = _rows(base, rank, t.name)
            got = _rows(layout, rank, b_name)
            assert got == {_peft(k): v for k, v in want.items()}, (t.name, rank)
            checked += 1
    assert checked >= 7 * 2 * layout.world_size // 2


def test_fsdp2_placements() -> None:
    model = _model("qwen2")
    layout = with_lora(fsdp2_layout(model, "fsdp:d2t2"), model, _config(model))
    pre = "model.layers.0."

    def placements(name: str) -> tuple[object, ...]:
        return layout.tensor(pre + name).sharding.placements

    # column parallel: B like the base (FSDP2's StridedShard over the TP split), A replicated on tp
    assert placements("self_attn.q_proj.weight") == (
        StridedShard(dim=0, split_factor=2),
        Shard(dim=0),
    )
    assert placements("self_attn.q_proj.lora_B.weight") == placements("self_attn.q_proj.weight")
    assert placements("self_attn.q_proj.lora_A.weight") == (Shard(dim=0), Replicate())
    # row parallel: A split by columns on tp, B replicated on tp; FSDP2 shards dim 0 of both
    assert placements("mlp.down_proj.lora_A.weight") == (Shard(dim=0), Shard(dim=1))
    assert placements("mlp.down_proj.lora_B.weight") == (Shard(dim=0), Replicate())


def test_megatron_fused_adapters() -> None:
    model = _model("qwen2")
    layout = with_lora(layout_for(model, "megatron:t2"), model, _config(model))
    pre = "decoder.layers.0."
    qkv = layout.tensor(pre + "self_attention.linear_qkv.weight")
    a = layout.tensor(pre + "self_attention.linear_qkv.lora_A.weight")
    b = layout.tensor(pre + "self_attention.linear_qkv.lora_B.weight")
    assert a.shape == (9, 16) and b.shape == (qkv.shape[0], 3)
    assert a.sharding.placements[-1] == Replicate()
    assert b.sharding.placements == qkv.sharding.placements
    assert [f.canonical.split(".")[-3] for f in a.fusion] == ["q_proj", "k_proj", "v_proj"]
    fc1_a = layout.tensor(pre + "mlp.linear_fc1.lora_A.weight")
    assert [f.canonical.split(".")[-3] for f in fc1_a.fusion] == ["gate_proj", "up_proj"]
    proj_a = layout.tensor(pre + "self_attention.linear_proj.lora_A.weight")
    assert proj_a.sharding.placements[-1] == Shard(dim=1)


@pytest.mark.parametrize("component", ["megatron:t2", "megatron:d2p2t2", "megatron:t4"])
def test_each_fused_lora_b_row_reads_the_member_of_its_base_row(component: str) -> None:
    """``adapter_row_members``: local row ``i`` of a fused ``lora_B`` reads member ``m``
    exactly where local row ``i`` of the base weight holds member ``m``'s canonical rows
    (q/k/v of ``linear_qkv``, gate/up of ``linear_fc1``), on every rank and stage."""
    model = model_from_hf_config(_cfg("qwen2", num_key_value_heads=4))
    base = layout_for(model, component)
    layout = with_lora(base, model, _config(model))
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    checked = 0
    for rank in range(layout.world_size):
        for lt in base.local_tensors(rank):
            if not lt.name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
                continue
            want = [-1] * lt.shape[0]
            for p in lt.pieces:
                assert p.canonical is not None
                for i in range(*p.local_box.ranges[0]):
                    want[i] = order[p.canonical.split(".")[-2]]
            b = lt.name.removesuffix(".weight") + ".lora_B.weight"
            assert adapter_row_members(layout, b, rank) == tuple(want), (b, rank)
            checked += 1
    assert checked == 2 * 2 * layout.world_size // (2 if "p2" in component else 1)


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_adapter_elements_are_r_times_in_plus_out(name: str) -> None:
    model = _model(name)
    config = _config(model)
    shapes = {t.name: t.shape for t in model.tensors}
    want = 0
    for t in model.tensors:
        parts = t.name.split(".")
        if (
            parts[0] == "model"
            and parts[1] == "layers"
            and parts[-2] in config.target_modules
            and parts[-1] == "weight"
            and "experts" not in parts
            and int(parts[2]) < model.num_layers
        ):
            out_f, in_f = shapes[t.name]
            want += 3 * (in_f + out_f)
    assert want > 0
    assert lora_param_count(model, config) == want
    assert sum(s.numel for s in lora_tensors(model, config)) == want
    layout = adapter_layout(layout_for(model, "fsdp:d1"), model, config)
    assert sum(t.numel for t in layout.local_tensors(0)) == want


def test_repr_evaluates_back() -> None:
    for config in (
        LoraConfig(rank=8),
        LoraConfig(
            rank=4, alpha=2.5, dropout=0.1, target_modules=("q_proj",), module_ranks={"q_proj": 2}
        ),
    ):
        assert eval(repr(config)) == config


def test_module_ranks() -> None:
    model = _model("qwen2")
    config = LoraConfig(rank=4, target_modules=("q_proj", "o_proj"), module_ranks={"o_proj": 2})
    shapes = {s.name.split(".", 5)[-1]: s.shape for s in lora_tensors(model, config)}
    assert shapes["self_attn.q_proj.lora_A.weight"] == (4, 16)
    assert shapes["self_attn.o_proj.lora_B.weight"] == (16, 2)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rank": 0}, r"LoraConfig.rank=0 must be an int >= 1"),
        ({"rank": 2, "alpha": 0}, r"LoraConfig.alpha=0 must be a finite number > 0"),
        ({"rank": 2, "dropout": 1.0}, r"LoraConfig.dropout=1.0 must be a number in \[0, 1\)"),
        ({"rank": 2, "target_modules": ("qkv",)}, r"target_modules has 'qkv'.*use names from"),
        ({"rank": 2, "target_modules": ()}, r"target_modules is empty"),
        ({"rank": 2, "target_modules": ("q_proj", "q_proj")}, r"names a module twice"),
        (
            {"rank": 2, "target_modules": ("q_proj",), "module_ranks": {"v_proj": 4}},
            r"module_ranks gives 'v_proj' a rank, but target_modules=\('q_proj',\) does not name it",
        ),
        (
            {"rank": 2, "target_modules": ("q_proj",), "module_ranks": [("q_proj",)]},
            r"module_ranks has \('q_proj',\); give \(module name, rank\) pairs",
        ),
        (
            {"rank": 2, "target_modules": ("q_proj",), "module_ranks": {"q_proj": 0}},
            r"module_ranks\['q_proj'\]=0 must be an int >= 1",
        ),
    ],
)
def test_config_refusals(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LoraError, match=match):
        LoraConfig(**kw)  # type: ignore[arg-type]


def test_model_refusals() -> None:
    moe = _model("qwen3_moe")
    with pytest.raises(
        LoraError, match=r"names \['gate_proj'\] in qwen3_moe, a MoE family.*attention"
    ):
        lora_tensors(moe, LoraConfig(rank=2, target_modules=("q_proj", "gate_proj")))
    with pytest.raises(
        LoraError, match=r"names \['q_proj'\], which deepseek_v3 has no linear layer of"
    ):
        lora_tensors(_model("deepseek_v3"), LoraConfig(rank=2, target_modules=("q_proj",)))
    dense = _model("qwen2")
    meg = layout_for(dense, "megatron:t2")
    with pytest.raises(
        LayoutError, match=r"linear_qkv.weight fuses .*but not .*k_proj.*target all"
    ):
        with_lora(meg, dense, LoraConfig(rank=2, target_modules=("q_proj", "v_proj")))
    ranks = LoraConfig(rank=2, target_modules=("gate_proj", "up_proj"), module_ranks={"up_proj": 4})
    with pytest.raises(LayoutError, match=r"linear_fc1.weight fuses .* ranks \[2, 4\]"):
        with_lora(meg, dense, ranks)
    # PEFT's separate adapters need no shared rank: FSDP2 takes the same configuration
    assert with_lora(layout_for(dense, "fsdp:d2"), dense, ranks).world_size == 2


@pytest.mark.parametrize(
    ("name", "src", "dst"),
    [("gpt_oss", "fsdp:d2t2", "megatron:p2t2"), ("qwen2", "megatron:d2t2", "sglang:t4")],
)
def test_transfer_and_checkpoint_plans_carry_the_adapters(name: str, src: str, dst: str) -> None:
    """Weight sync between two LoRA layouts reproduces the destination's adapters (and the
    bytes moved equal the lower bound); a checkpoint plan writes every adapter element once."""
    from areal_fn.plans.checkpoint.write import plan_save
    from areal_fn.plans.transfer import plan_transfers
    from areal_fn.plans.transfer.apply import apply_transfers
    from areal_fn.plans.transfer.bound import transfer_lower_bound

    model = _model(name)
    config = _config(model)
    a = with_lora(layout_for(model, src), model, config)
    b = with_lora(layout_for(model, dst), model, config)
    g = torch.Generator().manual_seed(5)
    canon = {s.name: torch.randn(s.shape, generator=g) for s in a.canonical}
    n = a.world_size
    ranks = {"src_ranks": range(n), "dst_ranks": range(n, n + b.world_size)}
    plan = plan_transfers(a, b, **ranks)
    src_t = {r: to_megatron(canon, a, r) for r in range(n)}
    dst_t = {
        n + j: {lt.name: torch.zeros(lt.shape) for lt in b.local_tensors(j)}
        for j in range(b.world_size)
    }
    apply_transfers(
        plan.transfers, src_t, dst_t, src_views=plan.src_views, dst_views=plan.dst_views
    )
    adapters = 0
    for j in range(b.world_size):
        for lt_name, t in to_megatron(canon, b, j).items():
            assert torch.equal(dst_t[n + j][lt_name], t), (j, lt_name)
            adapters += ".lora_" in lt_name
    assert adapters > 0
    assert plan.bytes_total == transfer_lower_bound(a, b, **ranks)
    written: dict[str, int] = {}
    for rw in plan_save(a).ranks:
        for p in rw.pieces:
            written[p.canonical] = written.get(p.canonical, 0) + p.box.numel
    assert written == {s.name: s.numel for s in a.canonical}
