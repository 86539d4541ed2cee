"""Laws of the packing planner: every sequence once, no row over budget, deterministic,
first-fit decreasing (checked against a direct re-implementation of its definition)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import PlanError
from areal_fn.plans.packing import pack_sequences, padded_row_length


@st.composite
def packing_inputs(draw: st.DrawFn) -> tuple[list[int], int, int]:
    multiple = draw(st.sampled_from([1, 2, 4, 8]))
    budget = multiple * draw(st.integers(1, 16))
    lengths = draw(st.lists(st.integers(1, budget), max_size=24))
    return lengths, budget, multiple


@given(packing_inputs())
def test_every_sequence_lands_in_exactly_one_row(case: tuple[list[int], int, int]) -> None:
    lengths, budget, multiple = case
    rows = pack_sequences(lengths, budget, multiple_of=multiple)
    flat = [i for row in rows for i in row]
    assert sorted(flat) == list(range(len(lengths)))
    for row in rows:
        assert row and list(row) == sorted(row)
        assert padded_row_length(lengths, row, multiple_of=multiple) <= budget
        assert padded_row_length(lengths, row, multiple_of=multiple) % multiple == 0
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert pack_sequences(lengths, budget, multiple_of=multiple) == rows


@given(packing_inputs())
def test_first_fit_decreasing(case: tuple[list[int], int, int]) -> None:
    lengths, budget, multiple = case
    rows: list[set[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for row in rows:
            if sum(lengths[j] for j in row) + lengths[i] <= budget:
                row.add(i)
                break
        else:
            rows.append({i})
    want = {frozenset(r) for r in rows}
    assert {frozenset(r) for r in pack_sequences(lengths, budget, multiple_of=multiple)} == want


@given(packing_inputs())
def test_at_most_one_row_is_half_empty(case: tuple[list[int], int, int]) -> None:
    lengths, budget, multiple = case
    rows = pack_sequences(lengths, budget, multiple_of=multiple)
    # first fit: at most one row is at most half full
    half = [r for r in rows if 2 * sum(lengths[i] for i in r) <= budget]
    assert len(half) <= 1


def test_examples() -> None:
    # 16, 16, 12, 10, 9 open rows; 7 joins 9, 5 joins 10, 3 joins 12
    lengths = [16, 5, 9, 12, 3, 16, 7, 10]
    assert pack_sequences(lengths, 16) == ((0,), (1, 7), (2, 6), (3, 4), (5,))
    assert pack_sequences([3, 3, 3], 8, multiple_of=2) == ((0, 1), (2,))
    assert pack_sequences([], 4) == ()
    assert padded_row_length([3, 4], (0, 1), multiple_of=4) == 8


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: pack_sequences([5, 17], 16),
            r"^sequence 1 has 17 tokens, more than max_tokens=16; "
            r"a sequence is never split or truncated: raise max_tokens_per_micro_batch to at least 17$",
        ),
        (
            lambda: pack_sequences([5, 17], 16, multiple_of=4),
            r"raise max_tokens_per_micro_batch to at least 20$",
        ),
        (
            lambda: pack_sequences([0], 4),
            r"^sequence 0 has length 0; every sequence needs at least 1 token$",
        ),
        (
            lambda: pack_sequences([1], 6, multiple_of=4),
            r"^max_tokens=6 must be a positive multiple of "
            r"multiple_of=4 \(rows are padded to multiples of 4\); use a budget such as 4$",
        ),
        (lambda: pack_sequences([1], 4, multiple_of=0), r"^multiple_of=0 must be >= 1"),
        (lambda: padded_row_length([1], (0,), multiple_of=0), r"^multiple_of=0 must be >= 1"),
    ],
)
def test_refusals(call: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        call()  # type: ignore[operator]
