"""One table of bad allocation inputs and their messages.

A string row is passed to ``parse_allocation`` and must raise exactly ``ParseError``
(three lines: the message, the input, a caret); ``caret`` pins the caret's column in
the input when given. A callable row builds a record or looks something up and must
raise ``SpecError``.
"""

import pytest

from areal_fn.errors import ParseError, SpecError
from areal_fn.strategy.allocation import Allocation, Backend, Component, ParallelDims
from areal_fn.strategy.parse import parse_allocation

FSDP4 = Component(backend=Backend.FSDP, dims=ParallelDims(dp=4))
SGLANG2 = Component(backend=Backend.SGLANG, dims=ParallelDims(dp=2))
LONG = "fsdp:d1+" * 40 + "x"

CASES = [
    # -- empty, characters, whitespace
    ("", r"empty allocation; expected at least one component such as 'fsdp:d8'", 0),
    (" \t\n", r"empty allocation", 0),
    (
        "d٤",
        r"non-ASCII digit '٤' \(U\+0664 ARABIC-INDIC DIGIT FOUR\); write numbers with the ASCII digits 0-9",
        1,
    ),
    ("fsdp:d４", r"non-ASCII digit '４' \(U\+FF14 FULLWIDTH DIGIT FOUR\)", 6),
    ("fsdp:d²", r"non-ASCII digit '²' \(U\+00B2 SUPERSCRIPT TWO\)", 6),
    (
        "fsdp:d4\u200b",
        r"character '\\u200b' \(U\+200B ZERO WIDTH SPACE\) is not allowed; allocation strings are printable ASCII",
        7,
    ),
    ("fsdp:d4\x00", r"character '\\x00' \(U\+0000\) is not allowed", 7),
    # whitespace is allowed between tokens (AReaL ignores it there), never inside one
    ("fs dp:d4", r"whitespace inside the backend 'fs dp'; write 'fsdp'", 2),
    (
        "megatron : d4 t2\t0",
        r"whitespace inside a number: t2 0; write the number without spaces \(t20\) or give each number its letter\n    megatron : d4 t2\\t0\n",
        16,
    ),
    ("fsdp:d1 024", r"whitespace inside a number: d1 024", 7),
    (
        "fsdp[ac tor]:d4",
        r"whitespace inside the name opened at position 4; a name is one identifier such as 'actor'",
        8,
    ),
    (
        "fsdp: \t",
        r"expected a dimension such as 'd4' after 'fsdp:' \(fsdp takes d, t, c \(p and e only as 1\)\), got end of input",
        5,
    ),
    ("fsdp:d4 d2", r"repeated dimension 'd' \(data parallel\), first given at position 5", 8),
    # -- HSDP: d<replicas>x<shards>, fsdp only
    (
        "sglang:d2x4",
        r"'x' after d2: HSDP replicas x shards \(d<replicas>x<shards>\) are for fsdp only; sglang takes d as one number",
        9,
    ),
    ("megatron:d2x4t2", r"'x' after d2: HSDP .* for fsdp only; megatron takes d as one number", 11),
    (
        "megatron:(attn:d2x2|ffn:e2)",
        r"'x' after d2: .*; the attn section takes d as one number",
        17,
    ),
    (
        "fsdp:t2x4",
        r"'x' goes right after d's number: fsdp writes HSDP as d<replicas>x<shards>, e.g. 'fsdp:d2x4'",
        7,
    ),
    ("fsdp:d2x", r"expected a number after 'x' \(e.g. 'x2'\), got end of input", 8),
    ("fsdp:d2x0", r"x0: every degree must be >= 1, got 0", 8),
    ("fsdp:d2x4d2", r"repeated dimension 'd' \(data parallel\), first given at position 5", 9),
    (
        "fsdp:d1024x2048",
        r"d1024x2048 is 2097152 data-parallel ranks, more than the maximum 1048576 \(2\*\*20\)",
        5,
    ),
    # -- backends
    (
        "d4t2",
        r"missing backend: 'd4t2' has no backend; start every component with one of sglang, vllm, fsdp, megatron, e.g. 'megatron:d4t2'",
        0,
    ),
    ("d0", r"missing backend: 'd0' has no backend", 0),
    ("sglang:d4+d4", r"missing backend: 'd4' has no backend", 10),
    (
        "[actor]:d4",
        r"missing backend before '\[': a component starts with its backend, e.g. 'fsdp\[actor\]:d4'",
        0,
    ),
    (
        "(attn:d4p2t2c2|ffn:d2p2t4e2)",
        r"missing backend before the hybrid form; write 'megatron:\(attn:...\|ffn:...\)'",
        0,
    ),
    ("attn:d4p2t2c2|ffn:d2p2t4e2", r"missing backend before the hybrid form", 0),
    ("sglan:d4", r"unknown backend 'sglan'; expected one of sglang, vllm, fsdp, megatron", 0),
    ("FSDP:d4", r"unknown backend 'FSDP'; backends are lower case: write 'fsdp'", 0),
    (
        "archon:d2",
        r"backend 'archon' is not supported; expected one of sglang, vllm, fsdp, megatron",
        0,
    ),
    ("sglang.d4", r"expected ':' after the backend 'sglang' \(e.g. 'sglang:d4'\), got '.'", 6),
    ("fsdp", r"expected ':' after the backend 'fsdp' \(e.g. 'fsdp:d4'\), got end of input", 4),
    # -- names
    (
        "fsdp(actor):d4",
        r"expected ':' or '\[' after 'fsdp' \(names go in square brackets, e.g. 'fsdp\[actor\]:d4'\), got '\('",
        4,
    ),
    (
        "fsdp[]:d4",
        r"expected a name after '\[' \(a letter or '_', then letters, digits or '_'\), got '\]'",
        5,
    ),
    ("fsdp[1a]:d4", r"expected a name after '\[' .*, got '1'", 5),
    ("fsdp[a-b]:d4", r"expected '\]' to close the name opened at position 4, got '-'", 6),
    (
        "sglang[a]:d1+fsdp[a]:d1",
        r"duplicate name 'a' \(first at position 7\); every name must be unique",
        18,
    ),
    (
        "sglang:d2+fsdp[actor]:d4+fsdp:d4",
        r"with 3 components every component needs a name, and this one has none; name it, e.g. 'sglang\[rollout\]:...'",
        0,
    ),
    (
        "sglang[r]:d2+fsdp[a]:d4|fsdp:d4",
        r"with 3 components every component needs a name, .* e.g. 'fsdp\[actor\]:...'",
        24,
    ),
    # -- dims and numbers
    (
        "fsdp:",
        r"expected a dimension such as 'd4' after 'fsdp:' \(fsdp takes d, t, c \(p and e only as 1\)\), got end of input",
        5,
    ),
    ("fsdp:d", r"expected a number after 'd' \(e.g. 'd2'\), got end of input", 6),
    ("fsdp:d+", r"expected a number after 'd' \(e.g. 'd2'\), got '\+'", 6),
    (
        "fsdp:d0",
        r"d0: every degree must be >= 1, got 0; write d1 or leave d out \(an omitted dimension is 1\)\n    fsdp:d0\n          \^",
        6,
    ),
    ("megatron:d2t00", r"t00: every degree must be >= 1, got 0", 12),
    ("fsdp:d04", r"d04 has a leading zero; write d4", 6),
    ("fsdp:d1.5", r"unexpected '.': degrees are whole numbers such as 'd4'", 7),
    ("fsdp:x4", r"'x' goes right after d's number", 5),
    ("fsdp:y4", r"unknown dimension 'y'; fsdp takes d, t, c \(p and e only as 1\)\n", 5),
    (
        "fsdp:D4",
        r"unknown dimension 'D'; fsdp takes d, t, c \(p and e only as 1\); dimensions are lower case",
        5,
    ),
    (
        "fsdp:d4d2",
        r"repeated dimension 'd' \(data parallel\), first given at position 5; give each dimension at most once\n    fsdp:d4d2\n           \^",
        7,
    ),
    (
        "megatron:p2d2t2p2",
        r"repeated dimension 'p' \(pipeline parallel\), first given at position 9",
        15,
    ),
    (
        "megatron:(attn:d2|ffn:e2e2)",
        r"repeated dimension 'e' \(expert parallel\), first given at position 22",
        24,
    ),
    (
        "fsdp:d2097152",
        r"d2097152 is too large \(7 digits\); every degree is at most 1048576 \(2\*\*20\)",
        6,
    ),
    ("fsdp:d" + "9" * 5000, r"is too large \(5000 digits\); every degree is at most 1048576", 6),
    (
        "fsdp:d1024t1024c1024",
        r"this component needs d\*p\*t\*c = 1024\*1\*1024\*1024 = 1073741824 ranks, more than the maximum 1048576 \(2\*\*20\)",
        0,
    ),
    (
        "fsdp[a]:d1048576+sglang[b]:d1",
        r"the allocation needs 1048577 ranks up to here, more than the maximum 1048576",
        17,
    ),
    # -- what each backend takes
    (
        "sglang:d4c2",
        r"sglang does not take c \(context parallel\); sglang takes d, p, t\n    sglang:d4c2\n             \^",
        9,
    ),
    ("vllm:d4e2", r"vllm does not take e \(expert parallel\); vllm takes d, p, t", 7),
    ("sglang:d4p2v2", r"sglang does not take v \(virtual pipeline stages\)", 11),
    (
        "fsdp:d4p2",
        r"fsdp does not support p \(pipeline parallel\) > 1, got p2; use megatron for pipeline parallelism\n    fsdp:d4p2\n           \^",
        7,
    ),
    (
        "fsdp:d2e2",
        r"fsdp does not support e \(expert parallel\) > 1, got e2; use megatron for expert parallelism",
        7,
    ),
    (
        "fsdp:d4v2",
        r"fsdp does not take v \(virtual pipeline stages\); .* use megatron with p >= 2 for virtual pipeline stages",
        7,
    ),
    (
        "megatron:d4v2",
        r"v2 \(virtual pipeline stages\) needs p >= 2, got p=1; add a pipeline, e.g. 'p2v2', or leave v out",
        11,
    ),
    (
        "megatron:d4t2e3",
        r"e3 \(expert parallel\) must divide d\*t\*c = 4\*2\*1 = 8, the ranks of one pipeline stage that the experts are spread over; use e in \{1, 2, 4, 8\}",
        13,
    ),
    ("megatron:d2p4e4", r"e4 \(expert parallel\) must divide d\*t\*c = 2\*1\*1 = 2", 13),
    # -- the hybrid form
    (
        "megatron:(attn:d4p2t1c1|ffn:d2p2t2e2)",
        r"the ffn section covers d\*p\*t\*e = 2\*2\*2\*2 = 16 ranks but the attn section covers d\*p\*t\*c = 4\*2\*1\*1 = 8; both sections must cover the same ranks: write ffn d1 or leave ffn d out to derive it",
        24,
    ),
    (
        "megatron:(attn:d4|ffn:d1t3)",
        r"ffn section covers .* = 3 ranks but the attn section covers .* = 4; .*: choose ffn t\*e in \{1, 2, 4\}",
        18,
    ),
    (
        "megatron:(attn:d2p2t1c4|ffn:d2p4t1e2)",
        r"ffn p4 differs from attn p2; attention and expert layers share one pipeline: write the same p in both sections or leave it out of ffn",
        30,
    ),
    (
        "megatron:(attn:d4|ffn:t2e3)",
        r"cannot derive ffn d: ffn t\*e = 2\*3 = 6 does not divide attn d\*t\*c = 4\*1\*1 = 4, the ranks of one pipeline stage; choose ffn t\*e in \{1, 2, 4\}",
        18,
    ),
    (
        "megatron:(attn:d4e2|ffn:d4)",
        r"e \(expert parallel\) belongs in the ffn section; the attn section takes d, p, t, c, v",
        17,
    ),
    (
        "megatron:(attn:d4|ffn:c2)",
        r"c \(context parallel\) belongs in the attn section; the ffn section takes d, p, t, e",
        22,
    ),
    (
        "megatron:(attn:d4p2|ffn:v2)",
        r"v \(virtual pipeline stages\) belongs in the attn section",
        24,
    ),
    (
        "megatron:(attn:d4|ffn:)",
        r"expected a dimension such as 'd4' after 'ffn:' \(the ffn section takes d, p, t, e\), got '\)'",
        22,
    ),
    ("megatron:(attn:d4v2|ffn:e2)", r"v2 \(virtual pipeline stages\) needs p >= 2", 17),
    (
        "sglang:(attn:d4|ffn:d4)",
        r"the hybrid form '\(attn:...\|ffn:...\)' is only for megatron, not sglang; write 'megatron:\(attn:...\|ffn:...\)'",
        7,
    ),
    # the hybrid form without parentheses is accepted; with one of them it is not
    ("megatron:attn:d4|ffn:d4)", r"unbalanced parentheses: '\)' has no matching '\('", 23),
    ("megatron:attn:d4", r"expected '\|' and the ffn section after the attn section", 16),
    ("megatron:ffn:d4|attn:d4", r"expected 'attn:' \(the attn section comes first", 9),
    ("megatron:attn d4|ffn:d4", r"expected ':' after 'attn', got 'd'", 14),
    (
        "megatron(attn:d4|ffn:d4)",
        r"expected ':' before the hybrid form: write 'megatron:\(attn:...\|ffn:...\)'",
        8,
    ),
    (
        "megatron:(ffn:d2|attn:d4)",
        r"expected 'attn:' \(the attn section comes first: '\(attn:...\|ffn:...\)'\), got 'ffn'",
        10,
    ),
    (
        "megatron:(attn:d4|attn:d4)",
        r"expected 'ffn:' \(the hybrid form has one attn and one ffn section\), got 'attn'",
        18,
    ),
    (
        "megatron:(attn:d4)",
        r"expected '\|' and the ffn section after the attn section \(e.g. '\|ffn:e2'\), got '\)'",
        17,
    ),
    (
        "megatron:(attn:d4|ffn:d4|fsdp:d4)",
        r"expected '\)' to close the '\(' at position 9, got '\|'",
        24,
    ),
    # -- operators and parentheses
    (
        "fsdp:d4+",
        r"expected a component after '\+', got end of input\n    fsdp:d4\+\n            \^",
        8,
    ),
    ("fsdp:d4 + ", r"expected a component after '\+', got end of input", 9),
    ("fsdp:d4|", r"expected a component after '\|', got end of input", 8),
    (
        "+fsdp:d4",
        r"expected a component starting with a backend \(sglang, vllm, fsdp, megatron\), got '\+'",
        0,
    ),
    ("sglang:d4++fsdp:d4", r"expected a component starting with a backend .*, got '\+'", 10),
    (
        "megatron:(attn:d4|ffn:d2",
        r"unbalanced parentheses: expected '\)' to close the '\(' at position 9, got end of input",
        24,
    ),
    ("fsdp:d4)", r"unbalanced parentheses: '\)' has no matching '\('", 7),
    ("megatron:(attn:d4|ffn:d4))", r"unbalanced parentheses: '\)' has no matching '\('", 25),
    ("(fsdp:d4)", r"unexpected '\(': parentheses only enclose the megatron hybrid form", 0),
    (
        "fsdp:d4|sglang:d2",
        r"colocated components share one rank range and need equal world sizes: 'fsdp:d4' has 4, this one has 2; change the degrees or disaggregate with '\+'",
        8,
    ),
    # -- long input: the quoted input is windowed around the caret
    (LONG, r"unknown backend 'x'; .*\n    \.\.\.:d1\+fsdp:d1\+.*fsdp:d1\+x\n {67}\^$", 63),
    # -- records
    (
        lambda: ParallelDims(dp=0),
        r"ParallelDims.dp=0 is out of range; every degree must be an int in \[1, 1048576\] \(2\*\*20\)",
        None,
    ),
    (
        lambda: ParallelDims(tp=True),
        r"ParallelDims.tp=True is not an int; pass a degree such as 2",
        None,
    ),
    (lambda: ParallelDims(cp=2.0), r"ParallelDims.cp=2.0 is not an int", None),
    (
        lambda: ParallelDims(vpp=2),
        r"ParallelDims.vpp=2 needs pp >= 2 \(virtual stages interleave a real pipeline\), got pp=1; set pp >= 2 or vpp=1",
        None,
    ),
    (
        lambda: ParallelDims(dp=2, ep=4),
        r"ParallelDims: ep\*etp = 4\*1 = 4 does not divide dp\*tp\*cp = 2\*1\*1 = 2, .*; choose ep\*etp in \{1, 2\}",
        None,
    ),
    (
        lambda: ParallelDims(dp=1024, tp=1024, cp=2),
        r"ParallelDims world size dp\*tp\*pp\*cp = 1024\*1024\*1\*2 = 2097152 exceeds the maximum 1048576",
        None,
    ),
    (
        lambda: ParallelDims(dp=6, dp_replicate=4),
        r"ParallelDims.dp_replicate=4 does not divide dp=6; HSDP splits the dp ranks into dp_replicate replicas x dp/dp_replicate shards; use dp_replicate in \{1, 2, 3, 6\}",
        None,
    ),
    (
        lambda: Component(backend=Backend.MEGATRON, dims=ParallelDims(dp=4, dp_replicate=2)),
        r"Component megatron: backend megatron does not support dp_replicate=2 \(only dp_replicate=1\); HSDP replicas x shards \('d2x4'\) are an fsdp spelling; write d as one number",
        None,
    ),
    (
        lambda: Component(backend=Backend.VLLM, dims=ParallelDims(dp=4, dp_replicate=4)),
        r"Component vllm: backend vllm does not support dp_replicate=4",
        None,
    ),
    (
        lambda: Component(backend="sglng", dims=ParallelDims()),
        r"Component.backend='sglng' is not a backend; use one of Backend.SGLANG, Backend.VLLM, Backend.FSDP, Backend.MEGATRON",
        None,
    ),
    (
        lambda: Component(name="a b", backend=Backend.FSDP, dims=ParallelDims()),
        r"Component.name='a b' is not an ASCII identifier",
        None,
    ),
    (
        lambda: Component(name="", backend=Backend.FSDP, dims=ParallelDims()),
        r"Component.name='' is not an ASCII identifier",
        None,
    ),
    (
        lambda: Component(backend=Backend.FSDP, dims="d4"),
        r"Component.dims='d4' is not a ParallelDims",
        None,
    ),
    (
        lambda: Component(backend=Backend.FSDP, dims=ParallelDims(dp=2, pp=2)),
        r"Component fsdp: backend fsdp does not support pp=2 \(only pp=1\); use megatron for pipeline parallelism",
        None,
    ),
    (
        lambda: Component(name="r", backend=Backend.VLLM, dims=ParallelDims(dp=2, ep=2)),
        r"Component vllm\[r\]: backend vllm does not support ep=2",
        None,
    ),
    (lambda: Allocation(groups=()), r"Allocation.groups is empty", None),
    (lambda: Allocation(groups=((),)), r"Allocation.groups\[0\] is empty", None),
    (
        lambda: Allocation(groups="fsdp:d4"),
        r"Allocation.groups='fsdp:d4' is not a tuple of groups",
        None,
    ),
    (
        lambda: Allocation(groups=(FSDP4,)),
        r"Allocation.groups\[0\]=Component\(.*\) is not a tuple of Component; wrap a single component as \(component,\)",
        None,
    ),
    (
        lambda: Allocation(groups=(("fsdp:d4",),)),
        r"Allocation.groups\[0\]\[0\]='fsdp:d4' is not a Component",
        None,
    ),
    (
        lambda: Allocation(groups=((FSDP4, SGLANG2),)),
        r"colocated components share one rank range and need equal world sizes, but fsdp:d4 has 4 and sglang:d2 has 2",
        None,
    ),
    (
        lambda: Allocation(
            groups=(
                (Component(name="a", backend=Backend.FSDP, dims=ParallelDims()),),
                (Component(name="a", backend=Backend.SGLANG, dims=ParallelDims()),),
            )
        ),
        r"Allocation: name 'a' is used twice",
        None,
    ),
    (
        lambda: Allocation(groups=((FSDP4,), (FSDP4,), (SGLANG2,))),
        r"Allocation: with 3 components every component needs a name, but fsdp:d4, fsdp:d4, sglang:d2 has none",
        None,
    ),
    # -- lookups
    (
        lambda: parse_allocation("fsdp:d4").component("actor"),
        r"no component is named 'actor' in fsdp:d4; names are \[\]",
        None,
    ),
    (lambda: parse_allocation("fsdp:d4").inference, r"fsdp:d4 has no inference component", None),
    (
        lambda: parse_allocation("sglang[r]:d4+fsdp[a]:d4|fsdp[b]:d4").training,
        r"has 2 training components \(fsdp\[a\]:d4, fsdp\[b\]:d4\); look one up by name with component\(name\), or use training_components",
        None,
    ),
    (
        lambda: parse_allocation("fsdp:d4+fsdp:d4").rank_range(FSDP4),
        r"component fsdp:d4 appears 2 times in fsdp:d4\+fsdp:d4; name the components",
        None,
    ),
    (
        lambda: parse_allocation("fsdp:d4").rank_range(SGLANG2),
        r"component sglang:d2 is not part of fsdp:d4",
        None,
    ),
]


def _id(case: tuple) -> str:
    given = case[0]
    return repr(given[:40]) if isinstance(given, str) else case[1][:40]


@pytest.mark.parametrize(("given", "message", "caret"), CASES, ids=[_id(c) for c in CASES])
def test_error_message(given: object, message: str, caret: int | None) -> None:
    if not isinstance(given, str):
        assert callable(given)
        with pytest.raises(SpecError, match=message):
            given()
        return
    with pytest.raises(ParseError, match=message) as info:
        parse_allocation(given)
    assert type(info.value) is ParseError
    lines = str(info.value).split("\n")
    assert len(lines) == 3
    assert lines[0].startswith("invalid allocation: ")
    if caret is not None and len(given) < 100:
        assert lines[2] == " " * (4 + caret) + "^", str(info.value)
