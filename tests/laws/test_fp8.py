"""Laws of block FP8 (:mod:`areal_fn.plans.fp8`, :mod:`areal_fn.model.quantized`).

- Dequantising equals DeepSeek-V3's published ``weight_dequant`` (per 128x128-style
  block of a ceil-div grid, edge blocks cut: ``x.float() * s``, stored in bf16),
  written here as a loop over blocks; a box dequantised equals the box of the whole.
- Ranks quantising the boxes of any tiling (cuts inside blocks included) by the plan
  (partial amaxes, the maximum over each cut block's holders, then elementwise) write
  bitwise the slices of the whole-tensor quantisation, each scale written once.
- Quantise then dequantise is within FP8's rounding of the input.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fn.errors import PlanError, SpecError
from areal_fn.model.quantized import Fp8Format, fp8_format, is_fp8_quantized
from areal_fn.model.spec import model_from_hf_config
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.fp8 import (
    FP8_MAX,
    block_amax,
    dequantize_fp8,
    fp8_checkpoint_bytes,
    plan_fp8_shards,
    quantize_fp8,
    scale_grid,
)
from areal_fn.sharding.box import Box


def reference_dequant(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``: one program per block of
    the ceil-div grid, masked at the edges, ``x.to(float32) * s[i, j]`` stored in bf16."""
    y = torch.empty(q.shape, dtype=torch.bfloat16)
    bm, bn = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
            y[blk] = (q[blk].to(torch.float32) * s[i, j]).to(torch.bfloat16)
    return y


@st.composite
def weights(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, int]]:
    block = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * draw(st.sampled_from([1e-3, 1.0, 300.0]))
    if draw(st.booleans()):  # a block of zeros keeps scale 1
        x[: block[0], : block[1]] = 0
    return x.to(torch.bfloat16), block


def _cuts(draw: st.DrawFn, n: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3, unique=True))
    return [0, *sorted(c for c in inner if 0 < c < n), n]


@st.composite
def tilings(draw: st.DrawFn, shape: tuple[int, int]) -> list[Box]:
    """A grid tiling of ``shape`` cut anywhere (inside blocks too), in a drawn rank order."""
    rows, cols = _cuts(draw, shape[0]), _cuts(draw, shape[1])
    boxes = [
        Box(ranges=((r0, r1), (c0, c1)))
        for r0, r1 in itertools.pairwise(rows)
        for c0, c1 in itertools.pairwise(cols)
    ]
    return draw(st.permutations(boxes))


def _whole(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8(x, block_amax(x, block=block), block=block)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@settings(max_examples=60, deadline=None)
@given(weights(), st.data())
def test_dequantise_is_deepseeks_reference_and_boxes_are_slices(w, data) -> None:
    x, block = w
    q, s = _whole(x, block)
    assert s.shape == scale_grid(tuple(x.shape), block)
    whole = dequantize_fp8(q, s, block=block, dtype=torch.bfloat16)
    assert torch.equal(whole, reference_dequant(q, s, block))
    r0 = data.draw(st.integers(0, x.shape[0] - 1))
    c0 = data.draw(st.integers(0, x.shape[1] - 1))
    box = Box(
        ranges=(
            (r0, data.draw(st.integers(r0 + 1, x.shape[0]))),
            (c0, data.draw(st.integers(c0 + 1, x.shape[1]))),
        )
    )
    grid = plan_fp8_shards(tuple(x.shape), [Box.full(x.shape)], block=block)
    assert grid.scale_box(0).shape == tuple(s.shape)
    (a0, a1), (b0, b1) = box.ranges
    sgrid = s[a0 // block[0] : -(-a1 // block[0]), b0 // block[1] : -(-b1 // block[1])]
    part = dequantize_fp8(
        q[box.slices()], sgrid, block=block, dtype=torch.bfloat16, origin=(r0, c0)
    )
    assert torch.equal(part, whole[box.slices()])


@settings(max_examples=60, deadline=None)
@given(weights(), st.data())
def test_ranks_of_any_tiling_write_the_slices_of_the_whole_quantisation(w, data) -> None:
    x, block = w
    boxes = data.draw(tilings(tuple(x.shape)))
    plan = plan_fp8_shards(tuple(x.shape), boxes, block=block)
    q, s = _whole(x, block)
    partial = {
        r: block_amax(x[b.slices()], block=block, origin=b.start) for r, b in enumerate(boxes)
    }
    amax = plan.combine(partial)
    written = torch.zeros(s.shape, dtype=torch.int64)
    for r, b in enumerate(boxes):
        qr, sr = quantize_fp8(x[b.slices()], amax[r], block=block, origin=b.start)
        assert torch.equal(_bits(qr), _bits(q[b.slices()]))
        assert torch.equal(sr, s[plan.scale_box(r).slices()])
        for u in plan.uses[r]:
            assert u.region == b.intersect(
                Box(ranges=tuple((i * k, (i + 1) * k) for i, k in zip(u.index, block, strict=True)))
            )
            assert (u.cut and len(u.holders) > 1) or u.region.shape == tuple(
                min(k, n - i * k) for i, k, n in zip(u.index, block, x.shape, strict=True)
            )
            written[u.index] += u.writer == r
    assert torch.equal(written, torch.ones_like(written))  # each scale written once
    assert sum(plan.bytes(r) for r in range(len(boxes))) == x.numel() + 4 * s.numel()


@settings(max_examples=40, deadline=None)
@given(weights())
def test_quantise_then_dequantise_is_within_fp8_rounding(w) -> None:
    x, block = w
    q, s = _whole(x, block)
    y = dequantize_fp8(q, s, block=block, dtype=torch.float32)
    scale = reference_dequant(torch.ones(x.shape).to(torch.float8_e4m3fn), s, block).float()
    xf = x.float()
    # e4m3: 3 mantissa bits (relative 2**-4), subnormal step 2**-9 of the scale
    assert bool(((y - xf).abs() <= xf.abs() * 2**-4 + scale * 2**-9).all())
    assert float(q.float().abs().max()) <= FP8_MAX


def test_every_fp8_code_dequantises_as_torch_casts_it() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    for q in (codes, codes.clone().view(torch.uint8).clamp_(max=0x7E).view(torch.float8_e4m3fn)):
        s = torch.tensor([[1.0, 3.0], [0.5, 2.0**-20]])
        got = dequantize_fp8(q, s, block=(8, 8), dtype=torch.float32)
        want = reference_dequant(q, s, (8, 8)).float()
        exact = (q.to(torch.float32).view(2, 8, 2, 8) * s[:, None, :, None]).view(16, 16)
        assert torch.equal(got.isnan(), exact.isnan())
        assert torch.equal(got.nan_to_num(), exact.nan_to_num())
        assert torch.equal(
            got.to(torch.bfloat16).nan_to_num(), want.to(torch.bfloat16).nan_to_num()
        )


def test_non_finite_weights_are_refused() -> None:
    x = torch.ones(4, 4)
    x[1, 2] = float("inf")
    with pytest.raises(Exception, match=r"w holds non-finite values \(inf or nan\), which FP8"):
        quantize_fp8(x, block_amax(x, block=(2, 2)), block=(2, 2), name="w")


def test_boxes_that_do_not_tile_are_refused() -> None:
    overlap = [Box(ranges=((0, 3), (0, 4))), Box(ranges=((2, 4), (0, 4)))]
    with pytest.raises(
        PlanError, match=r"add up to 20 elements, the weight has 16; overlapping pairs \[\(0, 1\)\]"
    ):
        plan_fp8_shards((4, 4), overlap, block=(2, 2))
    with pytest.raises(
        PlanError, match=r"add up to 12 elements, the weight has 16; overlapping pairs \[\]"
    ):
        plan_fp8_shards((4, 4), overlap[:1], block=(2, 2))
    with pytest.raises(PlanError, match=r"boxes of ranks \[0\] are not boxes of the 4x4"):
        plan_fp8_shards((4, 4), [Box(ranges=((0, 5), (0, 4)))], block=(2, 2))


DSV3_Q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


@pytest.mark.parametrize(
    ("q", "message"),
    [
        ({**DSV3_Q, "fmt": "e5m2"}, r"fmt='e5m2': FP8 values are read as float8_e4m3fn only"),
        (
            {**DSV3_Q, "activation_scheme": "static"},
            r"activation_scheme='static': static activation scales are not read",
        ),
        ({**DSV3_Q, "weight_block_size": None}, r"weight_block_size=None: per-tensor scales"),
        ({**DSV3_Q, "weight_block_size": [128, 0]}, r"weight_block_size=\[128, 0\] must be two"),
        ({**DSV3_Q, "scale_fmt": "ue8m0"}, r"scale_fmt='ue8m0': scales are read as float32"),
    ],
)
def test_fp8_configs_not_read_are_refused(q: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        fp8_format({"quantization_config": q})


def test_fp8_format_of_configs() -> None:
    assert fp8_format({}) is None
    assert fp8_format({"quantization_config": {"quant_method": "mxfp4"}}) is None
    fmt = fp8_format({"quantization_config": {**DSV3_Q, "weight_block_size": [128, 64]}})
    assert fmt == Fp8Format(block=(128, 64))
    assert fp8_format({"quantization_config": fmt.quantization_config()}) == fmt
    # transformers' FineGrainedFP8Config default block
    assert fp8_format({"quantization_config": {"quant_method": "fp8"}}) == Fp8Format(
        block=(128, 128)
    )


def test_the_rule_keeps_what_the_config_names() -> None:
    fmt = Fp8Format(keep=("model.layers.*.self_attn", "down_proj"))
    name = "model.layers.3.{}.weight"
    assert not is_fp8_quantized(name.format("self_attn.q_a_proj"), (8, 8), fmt)
    assert not is_fp8_quantized(name.format("mlp.experts.2.down_proj"), (8, 8), fmt)
    assert is_fp8_quantized(name.format("mlp.experts.2.up_proj"), (8, 8), fmt)
    assert not is_fp8_quantized(name.format("mlp.gate"), (8, 8), fmt)
    assert not is_fp8_quantized("lm_head.weight", (8, 8), fmt)


def test_checkpoint_bytes_are_the_plans() -> None:
    spec = model_from_hf_config("specs/models/DeepSeek-V3.json")
    fmt = fp8_format(spec.hf_config() | {"quantization_config": DSV3_Q})
    assert fmt is not None
    fp8, plain = fp8_checkpoint_bytes(spec, fmt)
    layer = [t for t in spec.tensors if t.name.startswith("model.layers.5.")]
    from_plans = sum(
        plan_fp8_shards(t.shape, [Box.full(t.shape)], block=fmt.block).bytes(0)
        if is_fp8_quantized(t.name, t.shape, fmt)
        else torch_dtype(t.dtype).itemsize * Box.full(t.shape).numel
        for t in layer
    )
    one_layer = model_from_hf_config(
        spec.hf_config() | {"num_hidden_layers": 6, "first_k_dense_replace": 3}
    )
    fp8_6, plain_6 = fp8_checkpoint_bytes(one_layer, fmt)
    fp8_5, plain_5 = fp8_checkpoint_bytes(
        model_from_hf_config(
            spec.hf_config() | {"num_hidden_layers": 5, "first_k_dense_replace": 3}
        ),
        fmt,
    )
    assert fp8_6 - fp8_5 == from_plans
    assert plain_6 - plain_5 == sum(
        torch_dtype(t.dtype).itemsize * Box.full(t.shape).numel for t in layer
    )
    # DeepSeek-V3 (without its MTP layer): about half of its bf16 size
    assert 0.50 < fp8 / plain < 0.52
