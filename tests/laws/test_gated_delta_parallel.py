"""The gated-delta-net families under parallelism: what runs and what is refused.

FSDP2 layouts split them over data-parallel ranks (HSDP included) and tensor-parallel
ranks (each rank's key-head groups: ``tests/oracles/test_gated_delta_tp.py``);
Ulysses / context parallelism are refused with the reason, on every path (layouts,
``check_strategy``, the advisor's rules). Megatron layouts hold them (Megatron-Core's
``GatedDeltaNet``) but for context parallelism, a ``tp`` that does not divide the linear
key heads, and the Transformer-Engine naming. Packed rows train in the FSDP2 engine: a
fact of transformers' modules pinned here is that a linear-attention layer does not
restart its state where ``position_ids`` restart (a packed row's second sequence sees the
first; full attention alone would not), so the FSDP2 engine runs each linear-attention
layer on every sequence of a packed row alone (``runtime/engines/linear_packed``); here
that wrapper on transformers' model against the same model run on each sequence alone
(the engine's own law, under FSDP2, is ``grad_worker.py``'s ``+pack`` cases).
"""

import json

import pytest
import torch

from areal_fn.errors import LayoutError, SpecError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.linear_attention import check_packing
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.engines import linear_packed, ulysses
from areal_fn.runtime.engines.fsdp2 import build_hf_model
from areal_fn.runtime.engines.packed import TokenSequence, pack_rows
from tests.distributed import gated_delta_configs
from tests.distributed.gated_delta_configs import rank_parts

FAMILIES = {
    "qwen3_next": gated_delta_configs.qwen3_next(),
    "qwen3_5_text": gated_delta_configs.qwen3_5_text(),
    "qwen3_5_moe_text": gated_delta_configs.qwen3_5_moe_text(),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fsdp2_data_parallel_layouts_and_refusals(name: str) -> None:
    spec = model_from_hf_config(FAMILIES[name])
    for ok, world in (("fsdp:d4", 4), ("fsdp:d2", 2), ("fsdp:d2t2", 4)):
        assert fsdp2_layout(spec, ok).world_size == world
    with pytest.raises(
        LayoutError,
        match=rf"cp=2: {name}'s linear-attention layers carry a recurrent state that must see",
    ):
        fsdp2_layout(spec, "fsdp:d2c2")
    assert megatron_layout(spec, "megatron:d2t2").world_size == 4
    with pytest.raises(
        LayoutError,
        match=rf"^cp=2: Megatron-Core 0.16's GatedDeltaNet has no context parallelism \({name}'s",
    ):
        megatron_layout(spec, "megatron:d2c2")
    with pytest.raises(
        LayoutError,
        match=rf"^tp=4 does not divide linear_num_key_heads=2 \({name}\); Megatron-Core's "
        r"GatedDeltaNet gives every TP rank whole key heads and their value heads; use tp in "
        r"\{1, 2\}$",
    ):
        # four KV heads, so that tp=4 breaks the linear key heads alone
        four_kv = model_from_hf_config({**FAMILIES[name], "num_key_value_heads": 4})
        megatron_layout(four_kv, "megatron:t4")
    with pytest.raises(LayoutError, match=rf"^naming='te' for {name}: the Transformer-Engine"):
        megatron_layout(spec, "megatron:d4", naming="te")
    check_packing(spec)  # packed rows run (each sequence's linear-attention layers alone)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_inference_tp_splits_full_attention_by_heads(name: str) -> None:
    """Inference layouts under TP: gated q_proj by heads (``[q_h; gate_h]`` rows stay
    together)."""
    spec = model_from_hf_config(FAMILIES[name])
    layout = inference_layout(spec, "sglang:d1t2")
    for rank in (0, 1):
        local = {lt.name: lt for lt in layout.local_tensors(rank)}
        q = local["model.layers.1.self_attn.q_proj.weight"]
        full = spec.tensor("model.layers.1.self_attn.q_proj.weight").shape
        assert q.shape == (full[0] // 2, full[1])
        (piece,) = q.pieces
        assert piece.canonical_box.ranges[0] == (rank * full[0] // 2, (rank + 1) * full[0] // 2)


#: (model, tp): the tiny configs and the published ones, up to one key head per rank
SPLITS = [
    *((n, tp) for n in sorted(FAMILIES) for tp in (1, 2)),
    ("specs/models/Qwen3-Next-80B-A3B-Instruct.json", 16),
    ("specs/models/Qwen3.5-27B.json", 8),
    ("specs/models/Qwen3.5-35B-A3B.json", 16),
]


@pytest.mark.parametrize(("name", "tp"), SPLITS)
def test_inference_tp_holds_each_ranks_key_head_groups(name: str, tp: int) -> None:
    """Every rank's boxes of every linear-attention tensor, in its local order, are the
    rows (``out_proj``: columns) vLLM's gated delta net loads on that rank
    (``qwen_gdn_linear_attn``: ``MergedColumnParallelLinear`` ``in_proj_qkvz`` /
    ``in_proj_ba``, ``conv1d`` by ``mamba_v2_sharded_weight_loader`` over ``[q; k; v]``,
    ``A_log`` / ``dt_bias`` by ``sharded_weight_loader(0)``, ``out_proj`` row-parallel,
    ``norm`` whole), computed here from the head counts (``rank_parts``)."""
    spec = model_from_hf_config(FAMILIES.get(name, name))
    la = spec.linear_attention
    assert la is not None
    heads = {
        "linear_num_key_heads": la.key_heads,
        "linear_num_value_heads": la.value_heads,
        "linear_key_head_dim": la.key_head_dim,
        "linear_value_head_dim": la.value_head_dim,
    }
    layer = la.layers.index(True)
    layout = inference_layout(spec, f"vllm:t{tp}")
    prefix = f"model.layers.{layer}.linear_attn."
    for rank in range(tp):
        want = rank_parts(heads, tp, rank)
        local = {
            t.name: lt
            for t in layout.tensors
            if t.name.startswith(prefix) and (lt := t.local(rank)) is not None
        }
        assert {n[len(prefix) :] for n in local} == {*want, "norm.weight"} & {
            t.name[len(prefix) :] for t in spec.layer_tensors(layer)
        }
        for name_, lt in local.items():
            rel, full = name_[len(prefix) :], spec.tensor(name_).shape
            dim = 1 if rel == "out_proj.weight" else 0
            pieces = sorted(lt.pieces, key=lambda p: p.local_box.ranges[dim][0])
            got = [i for p in pieces for i in range(*p.canonical_box.ranges[dim])]
            sel = want.get(rel, (0, full[0]))
            assert got == (list(range(*sel)) if isinstance(sel, tuple) else sel), (rel, rank)
            for p in pieces:  # every other dim whole
                for d, (lo, hi) in enumerate(p.canonical_box.ranges):
                    assert d == dim or (lo, hi) == (0, full[d]), (rel, rank)
            assert lt.shape[dim] == len(got)


def test_other_families_pack() -> None:
    cfg = {k: v for k, v in FAMILIES["qwen3_5_text"].items() if k != "layer_types"}
    check_packing(model_from_hf_config({**cfg, "model_type": "qwen3"}))


def test_transformers_linear_attention_does_not_reset_at_packed_boundaries() -> None:
    """Two sequences packed in one row (position_ids restarting at 0) against each run
    alone: the second one's logits move in transformers' Qwen3.5 (its linear-attention
    state and conv carry over the boundary); with every layer full attention (and the
    engines' attention function, whose mask follows ``position_ids``) they agree."""
    transformers = pytest.importorskip("transformers")
    outs = {}
    for kinds in (None, ["full_attention"] * 4):
        cfg = dict(FAMILIES["qwen3_5_text"])
        if kinds:
            cfg["layer_types"] = kinds
        spec = model_from_hf_config(cfg)
        rest = {k: v for k, v in spec.hf_config().items() if k != "model_type"}
        config = transformers.AutoConfig.for_model(spec.model_type, **rest)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        ulysses.install(model, None)  # the engines' attention: a causal mask per sequence
        a, b = torch.arange(1, 7), torch.arange(20, 29)
        with torch.no_grad():
            alone = model(input_ids=b[None]).logits[0]
            packed = model(
                input_ids=torch.cat([a, b])[None],
                position_ids=torch.cat([torch.arange(6), torch.arange(9)])[None],
            ).logits[0, 6:]
        outs["full" if kinds else "hybrid"] = float((alone - packed).abs().max())
    assert outs["full"] < 1e-5, outs
    assert outs["hybrid"] > 1e-3, outs


def test_sequence_spans_start_at_column_zero_and_every_position_zero() -> None:
    spans = linear_packed.sequence_spans
    rows = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    assert spans(rows) == (((0, 3), (3, 5)), ((0, 2), (2, 5)))
    assert spans(torch.tensor([[3, 4, 0, 1]])) == (((0, 2), (2, 4)),)
    assert spans(torch.arange(5).expand(2, 5)) is None  # one sequence a row: run whole
    assert spans(None) is None


#: Packed against one by one, fp32. Measured: logits <= 4.5e-8, gradients <= 1.4e-7 of
#: their largest entry; without ``linear_packed`` 1.3e-2 to 2.0e-2 and 3.5e-2 to 5.6e-2.
PACKED_LOGITS_ATOL = 1e-6
PACKED_GRAD_RTOL = 1e-5


@pytest.mark.parametrize(
    ("name", "checkpointing"),
    [("qwen3_next", True), ("qwen3_5_text", False), ("qwen3_5_moe_text", False)],
)
def test_linear_packed_runs_each_sequence_alone(name: str, checkpointing: bool) -> None:
    """Sequences of 7, 3, 12 and 5 tokens packed into one row by ``pack_rows`` (padded to
    28) through transformers' model with the engines' attention function and
    ``linear_packed``, against the same weights run on each sequence alone: every logit,
    and the gradient of a fixed linear function of them. Under activation checkpointing
    (qwen3_next) the recompute runs each layer again, its pre-hook included."""
    pytest.importorskip("transformers")
    spec = model_from_hf_config(FAMILIES[name])
    reference, model = build_hf_model(spec, seed=3), build_hf_model(spec, seed=3)
    ulysses.install(model, None)
    assert linear_packed.install(model, spec) == sum(spec.linear_attention.layers)
    if checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    gen = torch.Generator().manual_seed(1)
    seqs = [
        TokenSequence(input_ids=torch.randint(0, spec.vocab_size, (n,), generator=gen))
        for n in (7, 3, 12, 5)
    ]
    (row,) = pack_rows(seqs, max_tokens=32, multiple_of=4)
    assert row.input_ids.shape == (1, 28) and len(row.sequences) == 4
    weights = torch.randn(28, spec.vocab_size, generator=gen)
    packed = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False)
    (packed.logits[0, :27] * weights[:27]).sum().backward()  # the padding token left out
    alone = []
    for i, start in zip(row.sequences, row.offsets, strict=True):
        logits = reference(input_ids=seqs[i].input_ids[None], use_cache=False).logits[0]
        (logits * weights[start : start + len(seqs[i])]).sum().backward()
        alone.append(logits)
    got = packed.logits[0, :27].detach()
    logits_diff = float((got - torch.cat(alone).detach()).abs().max())
    assert logits_diff <= PACKED_LOGITS_ATOL, logits_diff
    grads = dict(reference.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in grads.values() if p.grad is not None)
    for pname, p in model.named_parameters():
        want = grads[pname].grad
        assert p.grad is not None and want is not None, pname
        diff = float((p.grad - want).abs().max()) / scale
        assert diff <= PACKED_GRAD_RTOL, (pname, diff)


def test_linear_layers_cost_no_sequence_squared_term_and_cache_no_tokens() -> None:
    """Per token, a linear-attention layer's FLOPs do not grow with the sequence (a full
    attention layer's do), and its cache does not grow with the context."""
    from areal_fn.pipeline.costs import flop_costs
    from areal_fn.plans.memory.kv_cache import kv_cache

    spec = model_from_hf_config(FAMILIES["qwen3_5_text"])  # layer 1 full, the others linear
    per_token = [flop_costs(spec, seq_len=s).layers for s in (64, 4096)]
    assert per_token[0][0] / 64 == per_token[1][0] / 4096
    assert per_token[0][1] / 64 < per_token[1][1] / 4096
    short, long = (kv_cache(spec, "sglang:d1", context_len=n) for n in (64, 4096))
    assert long.max_bytes - short.max_bytes == (4096 - 64) * long.bytes_per_token_layer
    assert short.stage_linear == (3,) and short.linear_state_elements > 0
    with pytest.raises(SpecError, match=r"kv_cache: tp=4 does not divide linear_num_key_heads=2"):
        kv_cache(spec, "sglang:d1t4", context_len=64)


def test_plan_on_the_published_configs(capsys: pytest.CaptureFixture[str]) -> None:
    """``areal-fn plan`` on Qwen3-Next-80B-A3B: the inference component's cache holds 12
    full-attention layers of tokens and 36 linear-attention states (each 32 value heads
    of 128 x 128 plus 3 conv inputs of 2 * 16 * 128 + 32 * 128 channels, split 4 ways);
    Megatron layouts held (context parallelism refused), Ulysses refused, with the reason."""
    from areal_fn.cli import main

    assert main(["plan", "Qwen3-Next-80B-A3B-Instruct", "fsdp:d8+sglang:d1t4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["num_params"] == 79_674_391_296
    kv = doc["components"][1]["kv_cache"]
    assert kv["stage_linear_layers"] == [36] and kv["stage_layers"] == [48]
    assert kv["linear_state_elements"] == (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) // 4
    full = 12 * kv["context_len"] * 2 * (2 // 2) * 256 * 2  # K and V, 1 KV head a rank, bf16
    assert kv["max_bytes"] == full + 36 * kv["linear_state_elements"] * 2
    assert main(["plan", "Qwen3-Next-80B-A3B-Instruct", "megatron:d4t2"]) == 0
    capsys.readouterr()
    for alloc, why in (("megatron:d4c2", "GatedDeltaNet has no context"), ("fsdp:d4c2", "cp=2")):
        assert main(["plan", "Qwen3-Next-80B-A3B-Instruct", alloc]) == 2
        assert why in capsys.readouterr().err
