"""AReaL's own allocation test strings, run through this parser.

The strings and the meaning AReaL's tests assert for them are copied as data from
``tests/test_allocation_mode.py`` of inclusionAI/AReaL at commit
4aef98d8d818af55b43621aaadba047ae10f4e77 (``TEST_CASES``, ``VALIDATION_ERROR_CASES``,
``TestModelAllocationFromStr``, ``test_backward_compatible_properties``,
``test_operator_precedence``). "And more": spellings AReaL's grammar
(``areal/api/alloc_mode.py``, ``ALLOCATION_GRAMMAR``: ``%ignore WS``,
``hybrid_moe_syntax: "("? attn_section "|" ffn_section ")"?``) accepts that its tests do
not write, with their meaning worked out by hand. Where this parser differs on purpose
(docs/allocation.md, "Differences from AReaL's parser"), the row says so.
"""

import pytest

from areal_fn.errors import ParseError
from areal_fn.strategy.allocation import Allocation, ParallelDims
from areal_fn.strategy.parse import parse_allocation

# (AReaL's id, input, what AReaL's test asserts), from TEST_CASES. Keys: n = number of
# allocations; gen_*/train_* = the one inference / training component's backend, dp, tp,
# pp, cp, etp, world size; names = component names in order; colocated = (name, with).
TEST_CASES: list[tuple[str, str, dict[str, object]]] = [
    (
        "inf_only_modern_colon",
        "sglang:d4p2t2",
        {"n": 1, "gen_backend": "sglang", "gen_world": 16},
    ),
    (
        "disagg_modern_simple",
        "sglang:d2+fsdp:d4",
        {"n": 2, "gen_backend": "sglang", "train_backend": "fsdp", "gen_dp": 2, "train_dp": 4},
    ),
    (
        "disagg_with_hybrid_moe",
        "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
        {"n": 2, "gen_backend": "sglang", "train_backend": "megatron"},
    ),
    (
        "fsdp_explicit",
        "fsdp:d4",
        {"n": 1, "gen_backend": None, "train_backend": "fsdp", "train_dp": 4},
    ),
    ("megatron_explicit", "megatron:d2p2t1", {"n": 1, "train_backend": "megatron", "train_pp": 2}),
    (
        "disagg_different_backends",
        "vllm:d2t4+megatron:d2p2t1",
        {"n": 2, "gen_backend": "vllm", "train_backend": "megatron", "gen_tp": 4, "train_pp": 2},
    ),
    (
        "megatron_hybrid_moe",
        "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        {"n": 1, "train_backend": "megatron", "train_etp": 4},
    ),
    (
        "disagg_with_inf_and_hybrid",
        "sglang:d4p1t2+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        {"n": 2, "gen_world": 8, "train_world": 32, "train_cp": 2},
    ),
    (
        "two_named_components",
        "sglang[rollout]:d2+fsdp[actor]:d4",
        {"n": 2, "names": ["rollout", "actor"], "backends": {"rollout": "sglang", "actor": "fsdp"}},
    ),
    (
        "three_named_components",
        "sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4",
        {"n": 3, "names": ["rollout", "actor", "critic"]},
    ),
    (
        "colocation_with_names",
        "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4",
        {"n": 3, "colocated": ("critic", "actor"), "separate": ["rollout", "actor"]},
    ),
    (
        "multi_agent_allocation",
        "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4",
        {"n": 4, "names": ["rollout1", "actor1", "rollout2", "actor2"]},
    ),
]

# TestModelAllocationFromStr and test_backward_compatible_properties: single components.
# (input, backend, dp, tp, pp, cp, ep, world)
FROM_STR = [
    ("fsdp:d4", "fsdp", 4, 1, 1, 1, 1, 4),
    ("sglang:d4t2", "sglang", 4, 2, 1, 1, 1, 8),
    ("vllm:d2t4p2", "vllm", 2, 4, 2, 1, 1, 16),
    ("megatron:d4t2p2", "megatron", 4, 2, 2, 1, 1, 16),
    ("megatron:(attn:d1p12t4|ffn:d1p12e4)", "megatron", 1, 4, 12, 1, 4, 48),
    ("fsdp:d4t2", "fsdp", 4, 2, 1, 1, 1, 8),
    ("fsdp:d4c2", "fsdp", 4, 1, 1, 2, 1, 8),
    ("fsdp:d1", "fsdp", 1, 1, 1, 1, 1, 1),
    ("sglang:d1", "sglang", 1, 1, 1, 1, 1, 1),
    ("megatron:d4t2p2", "megatron", 4, 2, 2, 1, 1, 16),
    ("fsdp:d1", "fsdp", 1, 1, 1, 1, 1, 1),
]

# VALIDATION_ERROR_CASES: refused by AReaL, refused here (with this parser's message).
REFUSED = [
    ("fsdp_pipeline", "fsdp:d4p2", r"fsdp does not support p \(pipeline parallel\) > 1"),
    ("fsdp_pipeline", "fsdp:d2e2", r"fsdp does not support e \(expert parallel\) > 1"),
    (
        "three_plus_without_names",
        "sglang:d2+fsdp[actor]:d4+fsdp:d4",
        r"every component needs a name",
    ),
    ("duplicate_names", "sglang[actor]:d2+fsdp[actor]:d4", r"duplicate name 'actor'"),
    ("hybrid_pp_mismatch", "(attn:d2p2t1c4|ffn:d2p4t1e2)", r"missing backend"),
    ("hybrid_world_mismatch", "(attn:d4p2t1c1|ffn:d2p2t2e2)", r"missing backend"),
    ("bare_dims_simple", "d1", r"missing backend"),
    ("bare_dims_complex", "d2p2t1", r"missing backend"),
    ("bare_dims_with_name", "[actor]:d4", r"missing backend before '\['"),
    ("bare_dims_in_multi_component", "sglang:d4+d4", r"missing backend"),
    ("bare_dims_named_in_multi", "vllm:d4+[actor]:d4", r"missing backend before '\['"),
    ("bare_hybrid_moe_no_backend", "attn:d4p2t2c2|ffn:d2p2t4e2", r"missing backend"),
    ("bare_hybrid_moe_parens_no_backend", "(attn:d4p2t2c2|ffn:d2p2t4e2)", r"missing backend"),
    # the same rules with a backend, so the rule itself is what refuses
    ("hybrid_pp_mismatch", "megatron:(attn:d2p2t1c4|ffn:d2p4t1e2)", r"ffn p4 differs from attn p2"),
    (
        "hybrid_world_mismatch",
        "megatron:(attn:d4p2t1c1|ffn:d2p2t2e2)",
        r"the ffn section covers d\*p\*t\*e = 2\*2\*2\*2 = 16 ranks",
    ),
    # TestModelAllocationFromStr.test_archon_simple: archon is not modelled here
    ("archon", "archon:d2", r"backend 'archon' is not supported"),
]

# Accepted here, refused by AReaL (colocation_without_names): two components need no
# names here; AReaL wants one on each colocated component after the first.
ACCEPTED_HERE = [("colocation_without_names", "fsdp:d4|fsdp:d4", "fsdp:d4|fsdp:d4", 4)]

# "And more": what AReaL's grammar accepts beyond its tests: whitespace between any two
# tokens and the hybrid form without its parentheses. (input, canonical, world)
MORE = [
    ("fsdp : d4", "fsdp:d4", 4),
    ("fsdp:d 4 t 2", "fsdp:d4t2", 8),
    ("megatron:( attn:d2t2 | ffn:e2t2 )", "megatron:(attn:d2t2|ffn:d1t2e2)", 4),
    ("megatron:attn:d2t2|ffn:e2t2", "megatron:(attn:d2t2|ffn:d1t2e2)", 4),
    ("megatron:attn:d1p12t4|ffn:d1p12e4", "megatron:d1p12t4e4", 48),
    ("megatron : attn : d4p2t2c2 | ffn : d2p2t4e2", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", 32),
    (
        "sglang:d4p1t2+megatron:attn:d4p2t2c2|ffn:d2p2t4e2",
        "sglang:d4t2+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        40,
    ),
    ("sglang [ rollout ] : d2 + fsdp [ actor ] : d4", "sglang[rollout]:d2+fsdp[actor]:d4", 6),
    ("\tsglang:d4p2t2\n+\nfsdp:d8\n", "sglang:d4p2t2+fsdp:d8", 24),
]


def _dims(a: Allocation, kind: str) -> ParallelDims:
    comp = a.inference if kind == "gen" else a.training
    return comp.dims


@pytest.mark.parametrize(("areal_id", "text", "expect"), TEST_CASES, ids=[c[0] for c in TEST_CASES])
def test_areal_test_cases_mean_the_same_here(areal_id: str, text: str, expect: dict) -> None:
    a = parse_allocation(text)
    assert parse_allocation(str(a)) == a
    assert len(a.components) == expect["n"]
    fields = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "etp": "etp", "world": "world_size"}
    for key, value in expect.items():
        kind, _, what = key.partition("_")
        if kind in ("gen", "train") and what == "backend":
            found = a.inference_components if kind == "gen" else a.training_components
            got = found[0].backend.value if found else None
            assert got == value, key
        elif kind in ("gen", "train"):
            assert getattr(_dims(a, kind), fields[what]) == value, key
    if "names" in expect:
        assert list(a.names) == expect["names"]
    for name, backend in expect.get("backends", {}).items():
        assert a.component(name).backend.value == backend
    if "colocated" in expect:
        name, anchor = expect["colocated"]
        assert a.rank_range(name) == a.rank_range(anchor)
        first, second = (a.rank_range(n) for n in expect["separate"])
        assert set(first).isdisjoint(second)


@pytest.mark.parametrize("case", FROM_STR, ids=[c[0] for c in FROM_STR])
def test_areal_single_components(case: tuple) -> None:
    text, backend, dp, tp, pp, cp, ep, world = case
    comp = parse_allocation(text).components[0]
    d = comp.dims
    assert (comp.backend.value, d.dp, d.tp, d.pp, d.cp, d.ep, d.world_size) == (
        backend,
        dp,
        tp,
        pp,
        cp,
        ep,
        world,
    )


def test_areal_ambiguous_properties() -> None:
    # test_backward_compatible_properties: .gen / .train refuse when there are several
    a = parse_allocation("sglang[r1]:d2+sglang[r2]:d2+fsdp[actor]:d4")
    with pytest.raises(ValueError, match="has 2 inference components"):
        _ = a.inference
    b = parse_allocation("sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4")
    with pytest.raises(ValueError, match="has 2 training components"):
        _ = b.training


@pytest.mark.parametrize(
    ("areal_id", "text", "message"), REFUSED, ids=[f"{c[0]}:{c[1]}" for c in REFUSED]
)
def test_areal_refusals_are_refused_here(areal_id: str, text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_allocation(text)


@pytest.mark.parametrize(("areal_id", "text", "canonical", "world"), ACCEPTED_HERE)
def test_deliberate_differences(areal_id: str, text: str, canonical: str, world: int) -> None:
    a = parse_allocation(text)
    assert (str(a), a.world_size) == (canonical, world)
    assert a.rank_ranges == (range(0, 4), range(0, 4))


@pytest.mark.parametrize(("text", "canonical", "world"), MORE, ids=[repr(c[0]) for c in MORE])
def test_what_areals_grammar_also_accepts(text: str, canonical: str, world: int) -> None:
    a = parse_allocation(text)
    assert str(a) == canonical
    assert a.world_size == world
    assert parse_allocation(canonical) == a
