"""Laws of delta encoding (:mod:`areal_fn.plans.delta`): round trip, minimal choice,
the delta applied to the old payload is the new one bitwise.

The sizes the laws compare against are counted here, element by element in Python
(bitmap bytes, runs, changed units), not taken from ``encoded_sizes``.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_fn.errors import PlanError
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.delta import (
    Encoding,
    apply_delta,
    change_mask,
    choose_encoding,
    decode_delta,
    delta_base_bytes,
    encode_changes,
    encode_delta,
)
from areal_fn.plans.transfer import bucket, plan_transfers
from areal_fn.strategy.allocation import ParallelDims

UNITS = (1, 2, 4, 8)


@st.composite
def payload_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[bool], int]:
    """(old, new, the mask of units that differ, unit): any mask, any bytes."""
    unit = draw(st.sampled_from(UNITS))
    mask = draw(st.lists(st.booleans(), max_size=200))
    shape = draw(st.sampled_from(["any", "runs", "none", "all"]))
    if shape == "runs":  # long runs: the case RUNS wins
        mask = [b for b in mask[:8] for _ in range(draw(st.integers(1, 40)))]
    elif shape in ("none", "all"):
        mask = [shape == "all"] * len(mask)
    old = draw(st.binary(min_size=len(mask) * unit, max_size=len(mask) * unit))
    new = bytearray(old)
    for i, changed in enumerate(mask):
        if changed:  # some byte of the unit differs
            j = i * unit + draw(st.integers(0, unit - 1))
            new[j] ^= draw(st.integers(1, 255))
    return as_tensor(old), as_tensor(bytes(new)), mask, unit


def as_tensor(b: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(b), dtype=torch.uint8)
        if b
        else torch.zeros(0, dtype=torch.uint8)
    )


def sizes_by_hand(mask: list[bool], unit: int) -> dict[Encoding, int]:
    n, k = len(mask), sum(mask)
    runs = sum(1 for i, b in enumerate(mask) if b and (i == 0 or not mask[i - 1]))
    bitmap = (n + 7) // 8
    bitmap += -bitmap % 8
    return {
        Encoding.DENSE: n * unit,
        Encoding.BITMAP: bitmap + k * unit,
        Encoding.RUNS: 8 + 8 * runs + k * unit,
    }


@given(payload_pairs())
def test_the_mask_is_the_units_that_differ(pair: tuple) -> None:
    old, new, mask, unit = pair
    assert change_mask(old, new, unit).tolist() == mask


@given(payload_pairs())
def test_encode_then_decode_is_the_new_payload_bitwise(pair: tuple) -> None:
    old, new, mask, unit = pair
    encoding, payload = encode_delta(old, new, unit)
    assert torch.equal(decode_delta(old, encoding, payload, unit), new)
    base = old.clone()
    apply_delta(base, encoding, payload, unit)
    assert torch.equal(base, new)
    _, again, index, values = encode_changes(old, new, unit)
    assert torch.equal(again, payload)
    assert index.tolist() == [i for i in range(old.numel() // unit) if mask[i]]
    written = old.clone()
    written.view(values.dtype)[index] = values
    assert torch.equal(written, new)


@given(payload_pairs())
def test_the_encoding_is_the_smallest_and_a_function_of_the_mask(pair: tuple) -> None:
    old, new, mask, unit = pair
    encoding, payload = encode_delta(old, new, unit)
    sizes = sizes_by_hand(mask, unit)
    assert payload.numel() == sizes[encoding] == min(sizes.values())
    assert encoding == min(sizes, key=lambda e: (sizes[e], e))
    assert choose_encoding(torch.tensor(mask, dtype=torch.bool), unit) == encoding


@given(payload_pairs(), st.sampled_from(list(Encoding)))
def test_every_encoding_round_trips_for_any_mask(pair: tuple, forced: Encoding) -> None:
    """Each encoding alone (not only the chosen one) carries any mask exactly."""
    old, new, mask, unit = pair
    encoding, payload = encode_delta(old, new, unit, encoding=forced)
    assert encoding == forced
    assert payload.numel() == sizes_by_hand(mask, unit)[forced]
    assert torch.equal(decode_delta(old, encoding, payload, unit), new)


@given(
    st.lists(st.floats(allow_nan=True, width=32), min_size=1, max_size=64), st.integers(0, 2**31)
)
def test_bf16_weights_nan_and_signed_zero_round_trip_bitwise(
    values: list[float], seed: int
) -> None:
    old = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    new = torch.where(torch.rand(old.shape, generator=gen) < 0.3, -old, old)  # -0.0, -nan
    o, n = old.view(torch.uint8), new.view(torch.uint8)
    encoding, payload = encode_delta(o, n, 2)
    got = decode_delta(o, encoding, payload, 2).view(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), new.view(torch.int16))


def test_malformed_payloads_are_refused() -> None:
    old = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(PlanError, match=r"a malformed delta payload: 3 bytes, dense needs 64"):
        decode_delta(old, Encoding.DENSE, torch.zeros(3, dtype=torch.uint8), 1)
    with pytest.raises(
        PlanError, match=r"a malformed delta payload: 4 bytes, the bitmap alone is 8"
    ):
        decode_delta(old, Encoding.BITMAP, torch.zeros(4, dtype=torch.uint8), 1)
    with pytest.raises(PlanError, match=r"1 bytes of values for 0 changed units of 1 bytes"):
        decode_delta(old, Encoding.BITMAP, torch.zeros(9, dtype=torch.uint8), 1)
    runs = torch.tensor([1, 0, 60, 10], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(
        PlanError, match=r"runs that are not increasing, disjoint and within 64 units"
    ):
        decode_delta(old, Encoding.RUNS, torch.cat([runs, torch.zeros(10, dtype=torch.uint8)]), 1)
    with pytest.raises(PlanError, match=r"cannot be read in units of 2 bytes"):
        encode_delta(torch.zeros(3, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8), 2)
    with pytest.raises(PlanError, match=r"the previous payload has 3 bytes and the new one 4"):
        encode_delta(torch.zeros(3, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), 1)


def test_a_source_keeps_what_it_sends() -> None:
    spec = model_from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "torch_dtype": "bfloat16",
        }
    )
    plan = plan_transfers(
        fsdp2_layout(spec, ParallelDims(dp=2)),
        inference_layout(spec, ParallelDims(tp=2)),
        src_ranks=[0, 1],
        dst_ranks=[2, 3],
    )
    bp = bucket(plan, 1 << 20, version=1)
    for rank in (0, 1):
        kept = delta_base_bytes(bp, rank)
        # every box packed once, 8-byte aligned: at least its bytes, under 8 more per box
        sent = plan.send_bytes()[rank]
        boxes = sum(1 for t in bp.transfers if t.src == rank and not t.is_local)
        assert sent <= kept < sent + 8 * boxes
        assert delta_base_bytes(bp, rank, itemsize=4) >= 2 * sent
    assert delta_base_bytes(bp, 2) == 0
