"""FP8 training where it runs on this CPU: torch 2.13's ``torch._scaled_mm`` (one scale
per tensor or per row; block scales refused), :func:`fp8_linear` against the
dequantised product, and ``Fsdp2Engine(float8_recipe=...)`` (torchao's float8) under
``fsdp:d2`` against torchao's converted model trained in one process
(``float8_worker.py``; only where torchao is installed). What does not run is refused in
one line with the reason (Megatron's FP8: ``test_megatron_options.py``)."""

import json
from pathlib import Path

import pytest
import torch

from areal_fn.errors import LayoutError, SpecError
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.memory import PrecisionPolicy
from areal_fn.runtime.engines import fp8_training
from areal_fn.runtime.engines.fp8_training import float8_refusal, fp8_linear
from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions
from areal_fn.runtime.launch import run_torchrun
from areal_fn.strategy.allocation import ParallelDims

WORKER = Path(__file__).with_name("float8_worker.py")
REPO = Path(__file__).resolve().parents[2]
E4M3 = torch.float8_e4m3fn


def _dequantised(t: torch.Tensor, *, rowwise: bool) -> torch.Tensor:
    """``t`` through float8_e4m3fn with torch's own cast: ``amax / 448`` scales."""
    amax = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().max()
    scale = amax.float() / torch.finfo(E4M3).max
    return (t.float() / scale).to(E4M3).float() * scale


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_dequantised_product(scaling: str, out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 96, generator=gen) * torch.linspace(0.1, 4, 48).unsqueeze(1)
    w = torch.randn(80, 96, generator=gen) * 0.05
    y = fp8_linear(x, w, scaling=scaling, out_dtype=out_dtype)
    rowwise = scaling == "rowwise"
    want = _dequantised(x, rowwise=rowwise) @ _dequantised(w, rowwise=rowwise).t()
    exact = x @ w.t()
    assert y.dtype == out_dtype and y.shape == (48, 80)
    rounding = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-6  # of the output dtype
    assert float((y.float() - want).abs().max()) <= rounding * float(want.abs().max())
    # e4m3 keeps 3 mantissa bits: each operand within 2**-4 relative, a product 2**-3
    bound = 2.0**-3 * (x.abs() @ w.abs().t()) + rounding * exact.abs()
    assert bool(((y.float() - exact).abs() <= bound).all())
    assert float((y.float() - exact).abs().max()) > 0  # it did quantise


def test_scaled_mm_on_this_cpu_refuses_block_scales() -> None:
    """What fp8_linear's refusal says: torch 2.13 takes no 1x128 / 128x128 scales here."""
    a = torch.randn(64, 256).to(E4M3)
    b = torch.randn(128, 256).to(E4M3)
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(64, 2), scale_b=torch.ones(2, 1))
    with pytest.raises(LayoutError, match=r"^fp8_linear: scaling='blockwise' is not one"):
        fp8_linear(torch.ones(16, 16), torch.ones(16, 16), scaling="blockwise")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"torchao": False, "tp": 1},
            r"^Fsdp2RunOptions\.float8_recipe='rowwise' trains the linear layers with torchao's "
            r"float8 \(convert_to_float8_training\), and torchao is not installed; pip install "
            r"torchao \(0\.18 installs beside torch 2\.13 without changing it\), or drop "
            r"float8_recipe$",
        ),
        ({"torchao": True, "tp": 2}, r"with tp=2 it needs torchao's float8 TP styles"),
        (
            {"torchao": True, "tp": 1, "precision": PrecisionPolicy.fp32_params_fp16_compute()},
            r"over plain fp32 linear layers, not with precision=params float32",
        ),
        ({"torchao": True, "tp": 1, "lora": object()}, r"not with LoRA adapters; drop one"),
    ],
)
def test_float8_is_refused_where_it_does_not_run(kwargs: dict, message: str) -> None:
    at = {"precision": None, "lora": None, **kwargs}
    assert float8_refusal(None, **at) == ""
    with pytest.raises(LayoutError, match=message):
        raise LayoutError(float8_refusal("rowwise", **at))


def test_the_engine_refuses_float8_without_torchao_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fp8_training, "torchao_installed", lambda: False)
    spec = model_from_hf_config(DEMO_CONFIG)
    with pytest.raises(LayoutError, match=r"and torchao is not installed"):
        Fsdp2Engine(
            spec, ParallelDims(dp=2), run_options=Fsdp2RunOptions(float8_recipe="tensorwise")
        )
    with pytest.raises(SpecError, match=r"^Fsdp2RunOptions\.float8_recipe='mxfp8' is not one of"):
        Fsdp2RunOptions(float8_recipe="mxfp8")


@pytest.mark.dist
def test_fsdp2_float8_equals_torchao_in_one_process(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="torchao is not installed: its float8 is refused")
    run_torchrun(WORKER, ["--out", str(tmp_path)], nproc=2, timeout_s=300, cwd=REPO)
    for recipe, r in json.loads((tmp_path / "float8.json").read_text()).items():
        (conv, ref_conv), (loss, ref_loss), (norm, ref_norm) = (
            r["converted"],
            r["loss"],
            r["grad_norm"],
        )
        assert conv == ref_conv == 14, recipe  # 2 layers x (q, k, v, o, gate, up, down)
        assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(
            ref_norm, rel=1e-6
        )
        assert r["weights_diff_conditioned"] <= 1e-6
        assert r["loss_vs_fp32"] > 1e-4 and r["weights_vs_fp32"] > 1e-4  # FP8 did compute
