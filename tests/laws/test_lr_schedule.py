"""The engines' learning-rate schedule: warm-up, decay, bounds, errors."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import SpecError
from areal_fn.runtime.engines.common import AdamWConfig, LRSchedule


def test_constant_by_default():
    cfg = AdamWConfig(lr=3e-4)
    assert [cfg.lr_at(s) for s in (0, 1, 10, 10_000)] == [3e-4] * 4


def test_warmup_then_cosine_values_written_out():
    sched = LRSchedule(warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    assert [sched.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert sched.factor(4) == 1.0  # decay starts at 1
    assert sched.factor(8) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos(pi/2) = 0
    assert sched.factor(12) == pytest.approx(0.1) and sched.factor(100) == pytest.approx(0.1)
    lin = LRSchedule(total_steps=10, decay="linear")
    assert [lin.factor(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


@given(
    st.integers(0, 50), st.integers(1, 200), st.floats(0, 1), st.sampled_from(["cosine", "linear"])
)
def test_factor_is_bounded_and_monotone_after_warmup(warmup, extra, floor, decay):
    sched = LRSchedule(
        warmup_steps=warmup, total_steps=warmup + extra, min_lr_ratio=floor, decay=decay
    )
    values = [sched.factor(s) for s in range(warmup + extra + 5)]
    assert all(floor - 1e-12 <= v <= 1.0 + 1e-12 or s < warmup for s, v in enumerate(values))
    tail = values[warmup:]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(tail))
    assert math.isclose(values[-1], floor, abs_tol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_steps": -1}, r"LRSchedule.warmup_steps=-1 must be an int >= 0"),
        ({"total_steps": 0}, r"LRSchedule.total_steps=0 must be None \(no decay\) or an int >= 1"),
        ({"warmup_steps": 5, "total_steps": 5}, r"total_steps=5 must exceed warmup_steps=5"),
        ({"min_lr_ratio": 1.5}, r"LRSchedule.min_lr_ratio=1.5 must lie in \[0, 1\]"),
        ({"decay": "step"}, r"LRSchedule.decay='step' is not a decay shape"),
    ],
)
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(SpecError, match=message):
        LRSchedule(**kwargs)
