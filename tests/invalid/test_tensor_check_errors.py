"""One table of tensors that do not match a layout or a model, with their messages.

:mod:`areal_fn.plans.tensor_check` owns the comparison; every caller's lists are cut
the same way: the first five entries, then ``... and N more``.
"""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import CheckpointError, ConversionError, LayoutError  # noqa: E402
from areal_fn.plans.convert import check_canonical, to_hf  # noqa: E402
from areal_fn.plans.tensor_check import (  # noqa: E402
    check_local_tensors,
    diff_shapes,
    joined,
    listing,
)
from tests.distributed.checkpoint_worker_util import layout, model  # noqa: E402

SPEC = model()
LAY = layout(SPEC, "fsdp:d2")


def shapes(rank: int) -> dict[str, tuple[int, ...]]:
    return {lt.name: lt.shape for lt in LAY.local_tensors(rank)}


def with_(rank: int, **edits: tuple[int, ...] | None) -> dict[str, tuple[int, ...]]:
    out = shapes(rank)
    for name, shape in edits.items():
        name = name.replace("__", ".")
        if shape is None:
            del out[name]
        else:
            out[name] = shape
    return out


def first(n: int, rank: int = 0) -> list[str]:
    return [lt.name for lt in LAY.local_tensors(rank)][:n]


def check(given: dict, *, error: type = LayoutError, **kw: object) -> None:
    check_local_tensors(LAY, given, error=error, **kw)


CASES = [
    (
        "a local tensor missing",
        lambda: check({0: shapes(0), 1: with_(1, model__norm__weight=None)}),
        LayoutError,
        r"^local states do not match the fsdp2 layout: rank 1 misses \['model\.norm\.weight'\]$",
    ),
    (
        "a tensor the layout does not name",
        lambda: check({0: with_(0, extra__weight=(1,))}),
        LayoutError,
        r"^local states do not match the fsdp2 layout: rank 0 has unexpected \['extra\.weight'\]$",
    ),
    (
        "a mis-shaped local tensor",
        lambda: check({1: with_(1, model__norm__weight=(3,))}),
        LayoutError,
        r"rank 1 mis-shaped \['model\.norm\.weight \(3,\) != \(32,\)'\]$",
    ),
    (
        "many missing: five named, the rest counted",
        lambda: check({0: {}}),
        LayoutError,
        r"rank 0 misses \["
        + ", ".join(f"'{n}'" for n in first(5)).replace(".", r"\.")
        + r"\] \.\.\. and 45 more$",
    ),
    (
        "a rank outside the layout",
        lambda: check({5: {}}),
        LayoutError,
        r"^local states do not match the fsdp2 layout: rank 5 is outside the fsdp2 layout's 2 ranks$",
    ),
    (
        "a rank not given when every rank must be",
        lambda: check({0: shapes(0)}, every_rank=True),
        LayoutError,
        r"^local states do not match the fsdp2 layout: no state for ranks \[1\]$",
    ),
    (
        "the caller's own problems follow the rank's tensors",
        lambda: check(
            {0: with_(0, model__norm__weight=(3,))}, also={0: ["rank 0: no adam state for w"]}
        ),
        LayoutError,
        r"rank 0 mis-shaped \['model\.norm\.weight \(3,\) != \(32,\)'\]; rank 0: no adam state for w$",
    ),
    (
        "many problems: five listed, the rest counted",
        lambda: check({r: {} for r in range(2)}, also={0: ["p1", "p2", "p3", "p4", "p5"]}),
        LayoutError,
        r"; p1; p2; p3; p4; \.\.\. and 2 more$",
    ),
    (
        "the caller's error class",
        lambda: check({0: {}}, error=CheckpointError),
        CheckpointError,
        r"^local states do not match the fsdp2 layout: rank 0 misses",
    ),
    (
        "to_hf: local states of another shape",
        lambda: to_hf(
            {
                r: {n: torch.zeros(s) for n, s in with_(r, model__norm__weight=(3,)).items()}
                for r in range(2)
            },
            LAY,
        ),
        ConversionError,
        r"^local states do not match the fsdp2 layout: rank 0 mis-shaped \['model\.norm\.weight "
        r"\(3,\) != \(32,\)'\]; rank 1 mis-shaped",
    ),
    (
        "check_canonical: many missing, five named",
        lambda: check_canonical({}, SPEC.tensors),
        ConversionError,
        r"^canonical tensors do not match the model: missing 50: \['model\.embed_tokens\.weight', "
        r"[^]]*\] \.\.\. and 45 more\. Nothing is dropped",
    ),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_mismatched_tensors_raise(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_matching_local_tensors_pass():
    check_local_tensors(LAY, {r: shapes(r) for r in range(2)}, error=LayoutError, every_rank=True)


def test_lists_show_five_and_count_the_rest():
    assert listing(["a", "b"]) == "['a', 'b']"
    assert listing([str(i) for i in range(7)]) == "['0', '1', '2', '3', '4'] ... and 2 more"
    assert joined(["a", "b"]) == "a, b"
    assert joined([str(i) for i in range(6)], "; ") == "0; 1; 2; 3; 4; ... and 1 more"


def test_diff_orders_missing_and_misshaped_as_expected_and_unexpected_sorted():
    d = diff_shapes({"b": (1,), "a": (2,), "c": (3,)}, {"z": (1,), "y": (1,), "a": (5,)})
    assert d.missing == ("b", "c")
    assert d.unexpected == ("y", "z")
    assert d.misshaped == (("a", (5,), (2,)),)
    assert not d.ok
    assert diff_shapes({"a": (1,)}, {"a": (1,)}).ok
