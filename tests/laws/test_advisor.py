"""The strategy advisor on the published configs: the usual guidance, and its own laws.

Guidance (80 GiB devices, bf16 weights, fp32 grads/master/Adam, 4k-token micro-batches
with recompute): small dense models on 8 devices -> FSDP first; 70B+ dense models ->
tensor and/or pipeline parallelism; MoE models -> expert parallelism at the top.
Laws: every suggestion fits and parses back, suggestions are sorted by score, the
result is deterministic, and the search stays fast for the largest model. The EP term:
its expected copies per token equal an enumeration of every routing, inside one node
``alltoall`` is the one-copy-per-expert formula, and ``deepep`` never sends more across
nodes nor takes longer (it can send more in all, through its NVLink relays).
"""

import functools
import itertools
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.advisor import Hardware, Suggestion, suggest_strategy
from areal_fn.plans.advisor.score import EP_DISPATCHES, ep_token_copies
from areal_fn.plans.memory import GIB, ActivationModel, PrecisionPolicy, estimate_memory
from areal_fn.plans.precision import engine_policy
from areal_fn.strategy.allocation import Backend
from areal_fn.strategy.parse import parse_allocation
from tools.golden import layout_for

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
GB80 = 80 * GIB


@functools.cache
def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


@functools.cache
def advise(name: str, n: int, margin: float = 0.1) -> tuple[Suggestion, ...]:
    return suggest_strategy(spec(name), n, GB80, top=5, memory_margin=margin)


@pytest.mark.parametrize(
    "name", ["Qwen2.5-0.5B", "Llama-3.2-1B", "Qwen2.5-7B", "Llama-3.1-8B", "Qwen3-8B"]
)
def test_small_dense_models_on_8_devices_get_fsdp_first(name):
    best = advise(name, 8)[0]
    assert best.backend is Backend.FSDP, best.why
    assert best.allocation == "fsdp:d8"
    assert "FSDP" in best.why and "free" in best.why


@pytest.mark.parametrize(
    ("name", "n", "margin"),
    [
        ("Llama-3.1-70B", 16, 0.0),
        ("Llama-3.1-70B", 64, 0.1),
        ("Qwen2.5-72B", 64, 0.1),
        ("Llama-3.1-405B", 128, 0.1),
    ],
)
def test_big_dense_models_get_tensor_or_pipeline_parallelism(name, n, margin):
    for s in advise(name, n, margin)[:3]:
        assert s.dims.tp > 1 or s.dims.pp > 1, s.why
        assert ("TP" in s.why) or ("bubble" in s.why)


@pytest.mark.parametrize(
    ("name", "n"),
    [("Qwen3-30B-A3B", 8), ("Qwen3-30B-A3B", 16), ("Qwen3-30B-A3B", 64), ("Qwen3-235B-A22B", 64)],
)
def test_moe_models_get_expert_parallelism_at_the_top(name, n):
    top = advise(name, n)
    assert top[0].dims.ep > 1, top[0].why
    assert "e" in top[0].allocation.split(":")[1] and "EP" in top[0].why
    assert sum(s.dims.ep > 1 for s in top[:3]) >= 2


@pytest.mark.parametrize(
    ("name", "n"), [("Qwen2.5-7B", 8), ("Llama-3.1-70B", 64), ("Qwen3-30B-A3B", 16)]
)
def test_suggestions_fit_parse_back_and_are_sorted(name, n):
    out = advise(name, n)
    assert 1 <= len(out) <= 5
    assert [s.score for s in out] == sorted(s.score for s in out)
    for s in out:
        assert s.memory.max_total <= 0.9 * GB80
        assert s.memory.world_size == n and len(s.memory.rows) == n
        comp = parse_allocation(s.allocation).components[0]
        assert comp.dims == s.dims and comp.backend is s.backend
        assert s.score == pytest.approx(s.comm.step_seconds)
        assert s.comm.compute_seconds > 0 and s.comm.bubble_seconds >= 0
        assert s.why.startswith(s.allocation + ": peak ") and str(s) == s.why


def test_backends_restrict_the_search():
    out = suggest_strategy(spec("Qwen2.5-7B"), 8, GB80, backends=("megatron",), top=3)
    assert all(s.backend is Backend.MEGATRON for s in out)
    assert suggest_strategy(spec("Qwen2.5-7B"), 8, GB80, backends="fsdp", top=1)[0].dims.dp == 8


@pytest.mark.parametrize(("name", "n"), [("Qwen2.5-7B", 8), ("Qwen3-30B-A3B", 16)])
def test_suggested_memory_equals_the_report_of_the_real_layout(name, n):
    model = spec(name)
    checked = 0
    for s in advise(name, n)[:2]:
        if model.num_layers % (s.dims.pp * s.dims.vpp):
            continue  # the advisor split unevenly; layout_for uses Megatron's even split
        component = parse_allocation(s.allocation).components[0]
        checked += 1
        report = estimate_memory(
            layout_for(model, component),
            engine_policy(PrecisionPolicy.bf16_mixed(), s.backend),  # what its engine runs
            activation=ActivationModel(micro_batch_size=1, seq_len=4096, recompute=True),
            model=model,
            dims=s.dims,
        )
        assert report == s.memory
    assert checked


def test_advice_is_deterministic():
    a = suggest_strategy(spec("Qwen3-30B-A3B"), 16, GB80, top=4)
    b = suggest_strategy(spec("Qwen3-30B-A3B"), 16, GB80, top=4)
    assert a == b and [s.why for s in a] == [s.why for s in b]


def test_the_largest_moe_model_on_256_devices_gets_expert_parallelism():
    # (how long advice takes is a benchmark's figure, not a test's: python -m bench memory)
    out = suggest_strategy(spec("Qwen3-235B-A22B"), 256, GB80, top=3)
    assert out[0].dims.ep > 1 and out[0].dims.world_size == 256


# -- the EP term: copies per token, split between the node's links and the network -------


def _enumerated_copies(
    experts: int, k: int, ep: int, per_node: int, groups: int, group_topk: int, dispatch: str
) -> list[tuple[Fraction, Fraction]]:
    """Expected (in-node, inter-node) copies of one token per source rank, by listing every
    kept-group set and every ``k``-subset of its experts (each equally likely)."""
    size, per = experts // groups, experts // ep
    node_of = [r // per_node for r in range(ep)]
    members = [[r for r in range(ep) if node_of[r] == b] for b in range(max(node_of) + 1)]
    draws = [
        picks
        for kept in itertools.combinations(range(groups), group_topk)
        for picks in itertools.combinations(
            [e for g in kept for e in range(g * size, (g + 1) * size)], k
        )
    ]
    out = []
    for a in range(ep):
        intra = inter = Fraction(0)
        for picks in draws:
            ranks = [e // per for e in picks]
            if dispatch == "alltoall":
                intra += sum(r != a and node_of[r] == node_of[a] for r in ranks)
                inter += sum(node_of[r] != node_of[a] for r in ranks)
                continue
            hit = set(ranks)
            intra += len({r for r in hit if r != a and node_of[r] == node_of[a]})
            for b, there in enumerate(members):
                if b != node_of[a] and hit & set(there):
                    inter += 1
                    relay = there[(a % per_node) % len(there)]
                    intra += len((hit & set(there)) - {relay})
        out.append((intra / len(draws), inter / len(draws)))
    return out


#: (experts, k, ep, per_node, groups, group_topk): one node, equal nodes, a smaller last
#: node, one rank per node, group-limited routing nested in ranks and straddling them.
EP_CASES = [
    (12, 4, 4, 4, 1, 1),
    (8, 2, 4, 2, 1, 1),
    (12, 3, 6, 4, 1, 1),
    (8, 3, 4, 1, 1, 1),
    (16, 3, 8, 4, 4, 2),
    (12, 2, 2, 1, 3, 2),
    (12, 4, 6, 2, 4, 3),
]


@pytest.mark.parametrize("dispatch", EP_DISPATCHES)
@pytest.mark.parametrize(("experts", "k", "ep", "per_node", "groups", "group_topk"), EP_CASES)
def test_ep_copies_equal_the_enumerated_expectation(
    experts, k, ep, per_node, groups, group_topk, dispatch
):
    got = ep_token_copies(
        experts=experts,
        k=k,
        ep=ep,
        per_node=per_node,
        dispatch=dispatch,
        groups=groups,
        group_topk=group_topk,
    )
    want = _enumerated_copies(experts, k, ep, per_node, groups, group_topk, dispatch)
    assert len(got) == ep
    for (gi, ge), (wi, we) in zip(got, want, strict=True):
        assert gi == pytest.approx(float(wi), rel=1e-12, abs=1e-15)
        assert ge == pytest.approx(float(we), rel=1e-12, abs=1e-15)


def test_ep_copies_by_hand():
    # 4 experts, one on each of 4 ranks, nodes {0, 1} and {2, 3}, k=2 (6 equally likely
    # pairs); from rank 0, alltoall sends k * 1/4 copies in the node and k * 2/4 across
    alltoall = ep_token_copies(experts=4, k=2, ep=4, per_node=2, dispatch="alltoall")
    assert alltoall[0] == (0.5, 1.0)
    # deepep: rank 1 is in 3 of the 6 pairs; node 1 in 5 of 6 (all but {0, 1}); its relay
    # for rank 0 is rank 2, so it fans out to rank 3 when rank 3 is hit (3 of 6)
    deepep = ep_token_copies(experts=4, k=2, ep=4, per_node=2, dispatch="deepep")
    assert deepep[0] == pytest.approx((3 / 6 + 3 / 6, 5 / 6))


@settings(max_examples=60)
@given(
    experts_log=st.integers(2, 8),
    k=st.integers(1, 8),
    ep_log=st.integers(1, 8),
    node_log=st.integers(0, 3),
    groups_log=st.integers(0, 3),
    data=st.data(),
)
def test_deepep_never_sends_more_across_nodes_nor_takes_longer(
    experts_log, k, ep_log, node_log, groups_log, data
):
    experts = 2**experts_log
    ep, groups = 2 ** min(ep_log, experts_log), 2 ** min(groups_log, experts_log)
    per_node = min(ep, 2**node_log)
    group_topk = data.draw(st.integers(1, groups))
    k = min(k, experts // groups * group_topk)
    layout = {"experts": experts, "k": k, "ep": ep, "per_node": per_node}
    layout |= {"groups": groups, "group_topk": group_topk}
    a = ep_token_copies(**layout, dispatch="alltoall")
    d = ep_token_copies(**layout, dispatch="deepep")
    hw = Hardware()

    def seconds(intra: float, inter: float) -> float:
        return max(intra / hw.intra_node_bandwidth, inter / hw.inter_node_bandwidth)

    for (ai, ae), (di, de) in zip(a, d, strict=True):
        assert ai + ae == pytest.approx(k * (ep - 1) / ep)  # one copy per expert off the rank
        assert de <= ae + 1e-12
        if per_node == ep:  # one node: per-rank dedup only
            assert de == 0 and di <= ai + 1e-12
    assert max(seconds(*p) for p in d) <= max(seconds(*p) for p in a) * (1 + 1e-12)


def test_deepep_can_send_more_bytes_in_all_through_its_nvlink_relays():
    # DeepSeek-V3 routing, EP=32 on 4 nodes of 8: fewer copies across nodes, more in all
    a = ep_token_copies(experts=256, k=8, ep=32, per_node=8, dispatch="alltoall")[0]
    d = ep_token_copies(
        experts=256, k=8, ep=32, per_node=8, dispatch="deepep", groups=8, group_topk=4
    )[0]
    assert a == (8 * 7 / 32, 8 * 24 / 32)
    assert d[1] < a[1] / 2 and sum(d) > sum(a)


def _ep_term(s: Suggestion):
    return {t.kind: t for t in s.comm.terms}["EP"]


@pytest.mark.parametrize("dispatch", EP_DISPATCHES)
def test_ep_inside_one_node_is_one_copy_per_expert_with_alltoall(dispatch):
    model = spec("Qwen3-30B-A3B")
    hw = Hardware(ep_dispatch=dispatch)
    out = suggest_strategy(model, 8, GB80, backends=("megatron",), top=20, hardware=hw)
    checked = 0
    for s in out:
        d = s.dims
        if d.ep == 1 or d.pp > 1:
            continue
        checked += 1
        term = _ep_term(s)
        m = -(-256 // d.dp)  # global batch 256, one sequence per micro-batch
        h, k, moe = model.hidden_size, model.num_experts_per_tok, sum(model.moe_layers)
        old = m * moe * 6 * (d.ep - 1) / d.ep * 4096 / (d.cp * d.tp) * k * h * 2
        assert term.link == "intra" and term.split is not None
        assert term.split.nodes == 1 and term.split.inter_bytes == 0
        assert term.bytes == term.split.intra_bytes
        assert f"over {d.ep} ranks, intra-node, {dispatch})" in str(term)
        if dispatch == "alltoall":
            assert term.bytes == round(old)
            assert term.seconds == pytest.approx(old / 300e9, rel=1e-12)
        else:
            assert 0 < term.bytes < old
    assert checked >= 2


def test_ep_across_nodes_takes_the_slower_link():
    model = spec("Qwen3-30B-A3B")
    out = suggest_strategy(model, 64, GB80, backends=("megatron",), top=200)
    across = [s for s in out if s.dims.ep > 8 and s.dims.tp == 1 and s.dims.pp == 1]
    assert across
    for s in across:
        term, ep = _ep_term(s), s.dims.ep
        sp = term.split
        assert sp is not None and term.link == "inter"
        assert (sp.nodes, sp.per_node, sp.dispatch) == (ep // 8, 8, "alltoall")
        assert term.bytes == sp.intra_bytes + sp.inter_bytes
        # 7 of the ep - 1 peers share the node
        assert sp.intra_bytes * (ep - 8) == pytest.approx(sp.inter_bytes * 7, rel=1e-9)
        slower = max(sp.intra_bytes / 300e9, sp.inter_bytes / 40e9)
        assert term.exposed == pytest.approx(slower, rel=1e-9)
        assert f"on {ep // 8} nodes of 8: " in str(term) and "GB inter-node, alltoall)" in str(term)
