"""The inputs of a pipeline partition, checked: per-layer costs, extras and counts.

The converters and validators of :class:`~areal_fn.pipeline.partition.StagePlan`'s
fields and the checks :func:`~areal_fn.pipeline.partition.partition_pipeline` and
:func:`~areal_fn.pipeline.partition.split_evenly` run before any search; every one
raises :class:`~areal_fn.errors.PlanError` naming the value, the rule and a remedy.
"""

import math
from collections.abc import Sequence

import attrs
import numpy as np

from areal_fn.errors import PlanError


def _num(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _costs(value: object) -> tuple[float, ...]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise PlanError(
            f"costs={value!r} is not a sequence of per-layer costs; pass one positive "
            "number per decoder layer, in layer order"
        )
    if set(map(type, value)) <= {float}:
        out = tuple(value)
    else:
        for i, c in enumerate(value):
            if not _num(c):
                raise PlanError(
                    f"costs[{i}]={c!r} is not a number; every layer cost must be a float > 0"
                )
        out = tuple(float(c) for c in value)
    if out and not (min(out) > 0.0 and max(out) < math.inf and not any(map(math.isnan, out))):
        i, c = next((i, c) for i, c in enumerate(out) if not 0.0 < c < math.inf)
        raise PlanError(
            f"costs[{i}]={c!r} is not a positive finite number; every layer cost must be "
            "> 0 and finite (a zero or NaN cost makes the balance meaningless); fix the "
            "cost model, or give the layer a small positive cost"
        )
    return out


def _extra(value: object) -> float:
    if not _num(value):
        raise PlanError(f"extra cost {value!r} is not a number; pass a float >= 0")
    return float(value)  # type: ignore[arg-type]


def _check_extra(inst: object, attr: "attrs.Attribute[float]", value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise PlanError(
            f"{attr.name}={value!r} must be finite and >= 0 (it is added to the "
            f"{'first' if attr.name == 'first_extra' else 'last'} chunk's load); pass 0.0 "
            "for no extra cost"
        )


def _check_count(inst: object, attr: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{attr.name}={value!r} must be an int >= 1")


def _check_problem(
    costs: tuple[float, ...], num_stages: int, vpp: int, allow_empty_ends: bool = False
) -> None:
    if vpp > 1 and num_stages == 1:
        raise PlanError(
            f"vpp={vpp} with num_stages=1: virtual pipeline stages interleave chunks over "
            "several pipeline ranks, so they need num_stages >= 2; use vpp=1, or "
            "num_stages >= 2"
        )
    k = num_stages * vpp
    if not costs:
        raise PlanError(
            "costs is empty: there are no layers to place; give one cost per decoder layer"
        )
    if allow_empty_ends and len(costs) < k - 2:
        raise PlanError(
            f"{len(costs)} layers cannot fill the {k - 2} inner chunks of num_stages="
            f"{num_stages} x vpp={vpp} = {k} chunks: allow_empty_ends=True lets only the "
            "first and the last chunk be empty, every inner chunk needs at least one layer; "
            f"use num_stages * vpp <= {len(costs) + 2}, or a model with more layers"
        )
    if not allow_empty_ends and len(costs) < k:
        fits = [
            f"num_stages={s}, vpp={v}"
            for s in range(1, len(costs) + 1)
            for v in range(1, len(costs) // s + 1)
            if s * v <= len(costs) and (v == 1 or s > 1) and s <= num_stages and v <= vpp
        ]
        hint = f"e.g. {fits[-1]}"
        raise PlanError(
            f"{len(costs)} layers cannot fill num_stages={num_stages} x vpp={vpp} = {k} "
            f"chunks: every chunk needs at least one layer; use num_stages * vpp <= "
            f"{len(costs)} ({hint}), or a model with more layers"
        )


def _lengths(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise PlanError(
            f"StagePlan.stage_lengths={value!r} is not a sequence; give the number of "
            "layers of each chunk, e.g. (3, 4, 4, 3)"
        )
    return tuple(value)


def _check_lengths(inst: object, attr: object, value: tuple[int, ...]) -> None:
    for i, n in enumerate(value):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PlanError(
                f"StagePlan.stage_lengths[{i}]={n!r} must be an int >= 1: every chunk holds "
                "at least one layer"
            )


def _check_nonempty(lengths: tuple[int, ...], allow_empty_ends: bool) -> None:
    """Every chunk holds a layer, except, with ``allow_empty_ends``, the first and the last."""
    last = len(lengths) - 1
    for i, n in enumerate(lengths):
        if n:
            continue
        if not allow_empty_ends:
            raise PlanError(
                f"StagePlan.stage_lengths[{i}]=0 must be an int >= 1: every chunk holds at "
                "least one layer; pass allow_empty_ends=True to let the first chunk hold "
                "only the embedding or the last only the head and loss"
            )
        if 0 < i < last:
            raise PlanError(
                f"StagePlan.stage_lengths[{i}]=0 is an empty inner chunk: allow_empty_ends="
                "True lets only the first and the last chunk be empty; give chunk "
                f"{i} at least one layer"
            )


def _validated(
    costs: object,
    num_stages: int,
    vpp: int,
    first_extra: object,
    last_extra: object,
    allow_empty_ends: bool = False,
) -> tuple[tuple[float, ...], float, float]:
    for name, value in (("num_stages", num_stages), ("vpp", vpp)):
        if isinstance(value, bool) or value < 1:
            raise PlanError(f"{name}={value!r} must be an int >= 1")
    cs = _costs(costs)
    fe, le = _extra(first_extra), _extra(last_extra)
    for name, x in (("first_extra", fe), ("last_extra", le)):
        if not (math.isfinite(x) and x >= 0.0):
            raise PlanError(
                f"{name}={x!r} must be finite and >= 0 (it is added to the "
                f"{'first' if name == 'first_extra' else 'last'} chunk's load); pass 0.0 "
                "for no extra cost"
            )
    _check_problem(cs, num_stages, vpp, allow_empty_ends)
    return cs, fe, le
