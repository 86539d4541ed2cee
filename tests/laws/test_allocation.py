"""Laws of the allocation grammar: round trips, spellings, derived sizes, robustness."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import ParseError
from areal_fn.strategy.allocation import Allocation, Backend, Component, ParallelDims
from areal_fn.strategy.parse import parse_allocation
from areal_fn.testing.allocation import allocations, components, parallel_dims

#: What `from areal_fn.strategy.allocation import *` brings into scope, for eval(repr(x)).
NAMESPACE: dict[str, object] = {}
exec("from areal_fn.strategy.allocation import *", NAMESPACE)

GRAMMAR_ALPHABET = "dtpcevsglanmfx:+|()[]0123456789_ "
POINTER = re.compile(r"\A {4}(?P<pad> *)\^\Z")


def parse_or_refuse(text: str) -> None:
    """``text`` parses to a value that round-trips, or raises a well-formed ParseError."""
    try:
        value = parse_allocation(text)
    except ParseError as exc:
        assert type(exc) is ParseError
        lines = str(exc).split("\n")
        assert len(lines) == 3, str(exc)
        assert lines[0].startswith("invalid allocation: ")
        assert lines[1].startswith("    ")
        assert POINTER.match(lines[2]), lines[2]
        return
    assert parse_allocation(str(value)) == value
    assert str(parse_allocation(str(value))) == str(value)


# -- round trips -----------------------------------------------------------------


@given(allocations())
def test_str_parses_back_to_an_equal_value(a: Allocation) -> None:
    text = str(a)
    b = parse_allocation(text)
    assert b == a
    assert str(b) == text


@given(allocations())
def test_repr_evaluates_back(a: Allocation) -> None:
    assert eval(repr(a), NAMESPACE) == a
    for comp in a.components:
        assert eval(repr(comp), NAMESPACE) == comp
        assert eval(repr(comp.dims), NAMESPACE) == comp.dims


@given(parallel_dims())
def test_dims_repr_evaluates_back(dims: ParallelDims) -> None:
    assert eval(repr(dims), NAMESPACE) == dims


@given(allocations())
def test_parsing_is_deterministic(a: Allocation) -> None:
    text = str(a)
    first, second = parse_allocation(text), parse_allocation(text)
    assert first == second
    assert hash(first) == hash(second)
    assert repr(first) == repr(second) == repr(a)


_WS = st.sampled_from(["", "", " ", "\t", "  ", "\n"])


def _spell_dims(
    draw: st.DrawFn,
    pairs: list[tuple[str, int]],
    takes: str,
    fallback: tuple[str, int] = ("d", 1),
    replicas: int = 1,
) -> str:
    """Dims in a drawn order, each dim at most once, explicit 1s sometimes written,
    whitespace between tokens; ``fallback`` when nothing else would be written (a
    section is never empty); ``d`` as ``d<replicas>x<shards>`` (fsdp) when
    ``replicas`` is not 1, and sometimes as ``d1x<dp>`` when it is."""
    present = {letter: value for letter, value in pairs if value != 1}
    for letter in takes.replace("x", ""):
        if letter not in present and draw(st.booleans()):
            present[letter] = 1
    if replicas > 1:
        present.setdefault("d", 1)
    if not present:
        present[fallback[0]] = fallback[1]
    order = draw(st.permutations(sorted(present)))
    out = []
    for letter in order:
        value = f"{present[letter]}"
        if letter == "d" and (replicas > 1 or ("x" in takes and draw(st.booleans()))):
            value = f"{replicas}{draw(_WS)}x{draw(_WS)}{present[letter] // replicas}"
        out.append(f"{draw(_WS)}{letter}{draw(_WS)}{value}")
    return "".join(out)


@st.composite
def spellings(draw: st.DrawFn) -> tuple[Allocation, str]:
    """A valid allocation and one of its many (mostly non-canonical) spellings:
    whitespace between any two tokens, hybrids with or without parentheses."""
    a = draw(allocations())
    ws = _WS
    out = []
    for group in a.groups:
        parts = []
        for comp in group:
            d = comp.dims
            head = comp.backend.value
            if comp.name is not None:
                head += f"{draw(ws)}[{draw(ws)}{comp.name}{draw(ws)}]"
            head += f"{draw(ws)}:{draw(ws)}"
            hybrid = comp.backend is Backend.MEGATRON and (d.etp != 1 or draw(st.booleans()))
            if not hybrid:
                takes = {"sglang": "dtp", "vllm": "dtp", "fsdp": "dtcpex", "megatron": "dptcev"}
                pairs = [
                    ("d", d.dp),
                    ("p", d.pp),
                    ("t", d.tp),
                    ("c", d.cp),
                    ("e", d.ep),
                    ("v", d.vpp),
                ]
                dims = _spell_dims(draw, pairs, takes[comp.backend.value], replicas=d.dp_replicate)
                parts.append(f"{head}{dims}")
                continue
            attn = _spell_dims(
                draw, [("d", d.dp), ("p", d.pp), ("t", d.tp), ("c", d.cp), ("v", d.vpp)], "dptcv"
            )
            ffn_pairs = [("t", d.etp), ("e", d.ep)]
            if draw(st.booleans()):
                ffn_pairs.append(("d", d.edp))
            if "p" in attn and draw(st.booleans()):
                ffn_pairs.append(("p", d.pp))
            ffn = _spell_dims(draw, ffn_pairs, "te", fallback=("d", d.edp))
            body = f"attn{draw(ws)}:{attn}{draw(ws)}|{draw(ws)}ffn{draw(ws)}:{ffn}"
            if draw(st.booleans()):
                body = f"({draw(ws)}{body}{draw(ws)})"
            parts.append(f"{head}{body}")
        out.append("".join(p + draw(ws) + "|" + draw(ws) for p in parts[:-1]) + parts[-1])
    text = draw(ws) + "".join(g + draw(ws) + "+" + draw(ws) for g in out[:-1]) + out[-1] + draw(ws)
    return a, text


@given(spellings())
def test_every_spelling_parses_to_the_value(case: tuple[Allocation, str]) -> None:
    a, text = case
    assert parse_allocation(text) == a
    assert str(parse_allocation(text)) == str(a)


# -- derived sizes ---------------------------------------------------------------


@given(parallel_dims())
def test_dims_tile_the_world(d: ParallelDims) -> None:
    assert d.world_size == d.dp * d.tp * d.pp * d.cp
    assert d.edp * d.ep * d.etp * d.pp == d.world_size
    assert d.vpp == 1 or d.pp > 1


@given(allocations())
def test_rank_ranges_are_consecutive_and_colocated_groups_share_one(a: Allocation) -> None:
    assert a.world_size == sum(group[0].world_size for group in a.groups)
    start = 0
    for group, rng in zip(a.groups, a.group_ranges, strict=True):
        assert rng == range(start, start + group[0].world_size)
        assert all(c.world_size == len(rng) for c in group)
        start = rng.stop
    assert start == a.world_size
    expected = [rng for group, rng in zip(a.groups, a.group_ranges, strict=True) for _ in group]
    assert list(a.rank_ranges) == expected
    for comp, rng in zip(a.components, a.rank_ranges, strict=True):
        if comp.name is not None:
            assert a.rank_range(comp.name) == rng
            assert a.component(comp.name) == comp


@given(components(backend=Backend.MEGATRON))
def test_megatron_components_round_trip_alone(c: Component) -> None:
    a = Allocation(groups=((c,),))
    assert parse_allocation(str(c)) == a
    assert (":(attn:" in str(c)) == (c.dims.etp != 1) == c.is_hybrid


# -- robustness ------------------------------------------------------------------


@given(st.text())
def test_any_text_parses_or_raises_parse_error(text: str) -> None:
    parse_or_refuse(text)


@given(st.text(alphabet=GRAMMAR_ALPHABET))
def test_grammar_alphabet_text_parses_or_raises_parse_error(text: str) -> None:
    parse_or_refuse(text)


@given(allocations(), st.data())
def test_edited_canonical_strings_parse_or_raise_parse_error(
    a: Allocation, data: st.DataObject
) -> None:
    text = str(a)
    i = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["delete", "insert", "replace"]))
    ch = data.draw(st.sampled_from(GRAMMAR_ALPHABET + "٤\t"))
    if edit == "delete":
        text = text[:i] + text[i + 1 :]
    elif edit == "insert":
        text = text[:i] + ch + text[i:]
    else:
        text = text[:i] + ch + text[i + 1 :]
    parse_or_refuse(text)


# -- examples from AReaL's documentation and tests, expected values by hand -----------

# (string, canonical string, world size,
#  [(label, (dp, tp, pp, cp, ep, etp, vpp), edp, (first rank, end rank)), ...])
AREAL_EXAMPLES = [
    ("fsdp:d4", "fsdp:d4", 4, [("fsdp", (4, 1, 1, 1, 1, 1, 1), 4, (0, 4))]),
    ("fsdp:d8p1t1", "fsdp:d8", 8, [("fsdp", (8, 1, 1, 1, 1, 1, 1), 8, (0, 8))]),
    ("fsdp:d2c2", "fsdp:d2c2", 4, [("fsdp", (2, 1, 1, 2, 1, 1, 1), 4, (0, 4))]),
    ("sglang:d4p2t2", "sglang:d4p2t2", 16, [("sglang", (4, 2, 2, 1, 1, 1, 1), 8, (0, 16))]),
    ("megatron:d2p2t1", "megatron:d2p2", 4, [("megatron", (2, 1, 2, 1, 1, 1, 1), 2, (0, 4))]),
    ("megatron:d4t2p2", "megatron:d4p2t2", 16, [("megatron", (4, 2, 2, 1, 1, 1, 1), 8, (0, 16))]),
    ("megatron:d2p2t4", "megatron:d2p2t4", 16, [("megatron", (2, 4, 2, 1, 1, 1, 1), 8, (0, 16))]),
    # e is carved out of d*t*c with etp=1 (AReaL passes etp=1 to Megatron): edp = 16/(2*4*1).
    (
        "megatron:d2p2t4e4",
        "megatron:d2p2t4e4",
        16,
        [("megatron", (2, 4, 2, 1, 4, 1, 1), 2, (0, 16))],
    ),
    (
        "sglang:d2+fsdp:d4",
        "sglang:d2+fsdp:d4",
        6,
        [("sglang", (2, 1, 1, 1, 1, 1, 1), 2, (0, 2)), ("fsdp", (4, 1, 1, 1, 1, 1, 1), 4, (2, 6))],
    ),
    (
        "sglang:d2t4+fsdp:d4t2",
        "sglang:d2t4+fsdp:d4t2",
        16,
        [("sglang", (2, 4, 1, 1, 1, 1, 1), 8, (0, 8)), ("fsdp", (4, 2, 1, 1, 1, 1, 1), 8, (8, 16))],
    ),
    (
        "vllm:d2t4+megatron:d2p2t1",
        "vllm:d2t4+megatron:d2p2",
        12,
        [
            ("vllm", (2, 4, 1, 1, 1, 1, 1), 8, (0, 8)),
            ("megatron", (2, 1, 2, 1, 1, 1, 1), 2, (8, 12)),
        ],
    ),
    # attn 4*2*2*2 = 32 ranks; ffn d2*p2*t4*e2 = 32; etp=4 keeps the hybrid form.
    (
        "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        32,
        [("megatron", (4, 2, 2, 2, 2, 4, 1), 2, (0, 32))],
    ),
    (
        "sglang:d4p1t2+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        "sglang:d4t2+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
        40,
        [
            ("sglang", (4, 2, 1, 1, 1, 1, 1), 8, (0, 8)),
            ("megatron", (4, 2, 2, 2, 2, 4, 1), 2, (8, 40)),
        ],
    ),
    (
        "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
        "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
        32,
        [
            ("sglang", (4, 2, 2, 1, 1, 1, 1), 8, (0, 16)),
            ("megatron", (2, 2, 2, 2, 2, 2, 1), 2, (16, 32)),
        ],
    ),
    # etp = 1 in the ffn section: the same configuration as the plain form, printed plain.
    (
        "megatron:(attn:d1p12t4|ffn:d1p12e4)",
        "megatron:d1p12t4e4",
        48,
        [("megatron", (1, 4, 12, 1, 4, 1, 1), 1, (0, 48))],
    ),
    (
        "megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)",
        "megatron:d1p4t2c2e4",
        16,
        [("megatron", (1, 2, 4, 2, 4, 1, 1), 1, (0, 16))],
    ),
    (
        "megatron:(attn:d2p2t2c8|ffn:d2p2e16)",
        "megatron:d2p2t2c8e16",
        64,
        [("megatron", (2, 2, 2, 8, 16, 1, 1), 2, (0, 64))],
    ),
    (
        "sglang[rollout]:d2+fsdp[actor]:d4",
        "sglang[rollout]:d2+fsdp[actor]:d4",
        6,
        [
            ("sglang[rollout]", (2, 1, 1, 1, 1, 1, 1), 2, (0, 2)),
            ("fsdp[actor]", (4, 1, 1, 1, 1, 1, 1), 4, (2, 6)),
        ],
    ),
    (
        "sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4",
        "sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4",
        10,
        [
            ("sglang[rollout]", (2, 1, 1, 1, 1, 1, 1), 2, (0, 2)),
            ("fsdp[actor]", (4, 1, 1, 1, 1, 1, 1), 4, (2, 6)),
            ("fsdp[critic]", (4, 1, 1, 1, 1, 1, 1), 4, (6, 10)),
        ],
    ),
    # '|' binds tighter than '+': actor and critic share ranks 2..5.
    (
        "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4",
        "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4",
        6,
        [
            ("sglang[rollout]", (2, 1, 1, 1, 1, 1, 1), 2, (0, 2)),
            ("fsdp[actor]", (4, 1, 1, 1, 1, 1, 1), 4, (2, 6)),
            ("fsdp[critic]", (4, 1, 1, 1, 1, 1, 1), 4, (2, 6)),
        ],
    ),
    (
        "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4",
        "vllm[rollout1]:d2t2+fsdp[actor1]:d4+vllm[rollout2]:d4+fsdp[actor2]:d4",
        16,
        [
            ("vllm[rollout1]", (2, 2, 1, 1, 1, 1, 1), 4, (0, 4)),
            ("fsdp[actor1]", (4, 1, 1, 1, 1, 1, 1), 4, (4, 8)),
            ("vllm[rollout2]", (4, 1, 1, 1, 1, 1, 1), 4, (8, 12)),
            ("fsdp[actor2]", (4, 1, 1, 1, 1, 1, 1), 4, (12, 16)),
        ],
    ),
    # New in areal_fn: v (virtual pipeline stages), printed last.
    (
        "megatron:d2p4v2t2",
        "megatron:d2p4t2v2",
        16,
        [("megatron", (2, 2, 4, 1, 1, 1, 2), 4, (0, 16))],
    ),
]


@pytest.mark.parametrize(
    ("text", "canonical", "world", "expected"), AREAL_EXAMPLES, ids=[e[0] for e in AREAL_EXAMPLES]
)
def test_areal_examples(text: str, canonical: str, world: int, expected: list) -> None:
    a = parse_allocation(text)
    assert str(a) == canonical
    assert parse_allocation(canonical) == a
    assert a.world_size == world
    got = [
        (
            c.label,
            (c.dims.dp, c.dims.tp, c.dims.pp, c.dims.cp, c.dims.ep, c.dims.etp, c.dims.vpp),
            c.dims.edp,
            (r.start, r.stop),
        )
        for c, r in zip(a.components, a.rank_ranges, strict=True)
    ]
    assert got == expected


SAME_VALUE = [
    ("megatron:t2d4", "megatron:d4t2"),
    ("megatron:(attn:d4t2|ffn:e2)", "megatron:d4t2e2"),
    ("megatron:(attn:d4p2t2c2|ffn:p2t4e2)", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)"),
    ("megatron:(attn:d4p2t2c2|ffn:t4e2)", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)"),
    ("megatron:(attn:d4 | ffn:t2)", "megatron:(attn:d4|ffn:d2t2)"),
    (" sglang:d4 +\tfsdp:d4\n", "sglang:d4+fsdp:d4"),
    ("fsdp:d8p1e1t1c1", "fsdp:d8"),
    ("megatron:d2p2v1", "megatron:d2p2"),
    ("sglang:t1", "sglang:d1"),
]


@pytest.mark.parametrize(("text", "canonical"), SAME_VALUE)
def test_spellings_of_one_value(text: str, canonical: str) -> None:
    assert str(parse_allocation(text)) == canonical
    assert parse_allocation(text) == parse_allocation(canonical)


def test_lookups() -> None:
    a = parse_allocation("sglang[rollout]:d2t2+megatron[actor]:d2p2|fsdp[ref]:d4")
    assert a.inference == a.component("rollout")
    assert a.training_components == (a.component("actor"), a.component("ref"))
    assert a.by_backend(Backend.FSDP) == (a.component("ref"),)
    assert a.rank_range("actor") == a.rank_range("ref") == range(4, 8)
    assert a.rank_range(a.component("rollout")) == range(0, 4)
    assert a.names == ("rollout", "actor", "ref")
    assert parse_allocation("sglang:d4+fsdp:d4").training.backend is Backend.FSDP
    assert Backend.SGLANG.is_inference and not Backend.SGLANG.is_training
    assert Backend.MEGATRON.is_training and not Backend.MEGATRON.is_inference
