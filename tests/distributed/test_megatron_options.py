"""MegatronEngine's run options: activation recompute (full and selective, Megatron-Core's
own settings) and gradient-reduce overlap leave two steps' results unchanged and, for
recompute, lower the activation bytes saved for backward (``megatron_options_worker.py``:
one 4-rank launch, ``megatron:d2p2``); what does not run is refused in one line."""

import json
from pathlib import Path
from typing import Any

import pytest

from areal_fn.errors import LayoutError, SpecError
from areal_fn.runtime.engines.megatron_options import MegatronRunOptions, megatron_option_fields
from areal_fn.runtime.launch import run_torchrun

WORKER = Path(__file__).with_name("megatron_options_worker.py")
REPO = Path(__file__).resolve().parents[2]
WORLD = 4
FIRST_STAGE = (0, 1)  # megatron:d2p2 in Megatron's tp-cp-ep-dp-pp order: pp rank 0
RECOMPUTE = ("full-uniform-1", "full-block-1", "selective")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("megatron_options")
    run_torchrun(WORKER, ["--out", str(out)], nproc=WORLD, timeout_s=600, cwd=REPO)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.dist
def test_every_case_ran_on_every_rank(records: list[dict[str, Any]]) -> None:
    errors = {
        (r, c): v["error"] for r, rec in enumerate(records) for c, v in rec.items() if "error" in v
    }
    assert not errors, errors
    assert all(len(rec) == 8 for rec in records)


@pytest.mark.dist
@pytest.mark.parametrize(
    "case",
    ["qwen2/full-uniform-1", "qwen2/full-block-1", "qwen2/overlap", "deepseek_v3/full+overlap"],
)
def test_full_recompute_and_overlap_are_bitwise_the_plain_step(
    records: list[dict[str, Any]], case: str
) -> None:
    ref = "deepseek_v3/none" if case.startswith("deepseek") else "qwen2/none"
    for rec in records:
        got = rec[case]
        assert got["loss"] == rec[ref]["loss"] and got["grad_norm"] == rec[ref]["grad_norm"]
        assert [got[k] for k in ("g1_diff", "w1_diff", "g2_diff", "w2_diff")] == [0.0] * 4


@pytest.mark.dist
@pytest.mark.parametrize("case", ["qwen2/selective", "deepseek_v3/selective"])
def test_selective_recompute_equals_the_plain_step_to_rounding(
    records: list[dict[str, Any]], case: str
) -> None:
    """The same forward (equal losses); backward sums some gradients in another order."""
    ref = case.split("/")[0] + "/none"
    for rec in records:
        got = rec[case]
        assert got["loss"][0] == rec[ref]["loss"][0]
        assert got["loss"][1] == pytest.approx(rec[ref]["loss"][1], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(rec[ref]["grad_norm"], rel=1e-6)
        assert got["g1_diff"] <= 1e-6 and got["g2_diff"] <= 1e-6
        assert got["w1_unexplained"] <= 1e-6


@pytest.mark.dist
def test_recompute_lowers_the_saved_activation_bytes(records: list[dict[str, Any]]) -> None:
    for rec in records:
        plain = rec["qwen2/none"]["saved_peak"]
        full, block, selective = (rec[f"qwen2/{c}"]["saved_peak"] for c in RECOMPUTE)
        assert full < block < plain and selective < plain
        assert rec["deepseek_v3/selective"]["saved_peak"] < rec["deepseek_v3/none"]["saved_peak"]
        assert rec["deepseek_v3/full+overlap"]["saved_peak"] < rec["deepseek_v3/none"]["saved_peak"]
        assert rec["qwen2/overlap"]["saved_peak"] == plain


@pytest.mark.dist
def test_overlap_starts_bucket_reduces_inside_backward(records: list[dict[str, Any]]) -> None:
    """From the second step on (Megatron's DDP learns the order grads come in the first),
    on the first pipeline stage (Megatron buckets only there); never without the option."""
    for r, rec in enumerate(records):
        for case in ("qwen2/overlap", "deepseek_v3/full+overlap"):
            first, second = rec[case]["async_reduces_in_backward"]
            assert first == 0 and (second > 1 if r in FIRST_STAGE else second == 0)
        assert rec["qwen2/none"]["async_reduces_in_backward"] == [0, 0]


def test_options_become_megatron_fields() -> None:
    options = MegatronRunOptions(
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=2,
        overlap_grad_reduce=True,
        bucket_size=1000,
    )
    config, ddp = megatron_option_fields(options, mla=False, te_installed=False, device_type="cpu")
    assert config == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
        "recompute_modules": ["core_attn"],
    }
    assert ddp == {"overlap_grad_reduce": True, "bucket_size": 1000}
    plain = megatron_option_fields(
        MegatronRunOptions(), mla=False, te_installed=False, device_type="cpu"
    )
    assert plain == ({}, {"overlap_grad_reduce": False})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"recompute_granularity": "full"},
            r"^MegatronRunOptions: recompute_granularity='full' needs recompute_method \('uniform' "
            r"or 'block'\) and recompute_num_layers, got None and None; e\.g\.",
        ),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            r"recompute_num_layers=1 apply to recompute_granularity='full' only \(it is "
            r"'selective'\); leave them None$",
        ),
        (
            {"recompute_granularity": "partial"},
            r"^MegatronRunOptions\.recompute_granularity='partial' is not one of \('full', "
            r"'selective'\) or None$",
        ),
        (
            {"recompute_modules": ("mlp", "moe_act")},
            r"^MegatronRunOptions\.recompute_modules=\('mlp', 'moe_act'\): \['moe_act'\] not "
            r"recomputable here; choose from .* \(moe_act needs grouped GEMM, a CUDA kernel\)$",
        ),
        ({"bucket_size": 0}, r"^MegatronRunOptions\.bucket_size=0 must be None or an int >= 1$"),
        ({"fp8_recipe": "e4m3"}, r"^MegatronRunOptions\.fp8_recipe='e4m3' is not one of"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        MegatronRunOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "where", "message"),
    [
        (
            {"overlap_param_gather": True},
            {},
            r"^MegatronEngine: overlap_param_gather overlaps the distributed optimizer's parameter "
            r"all-gather .* use overlap_grad_reduce alone$",
        ),
        (
            {"recompute_granularity": "selective", "recompute_modules": ("mla_up_proj",)},
            {},
            r"^MegatronEngine: recompute_modules 'mla_up_proj' recomputes multi-latent attention's "
            r"up projection, and this model has none; drop it$",
        ),
        (
            {"fp8_recipe": "blockwise"},
            {},
            r"^MegatronEngine: fp8_recipe='blockwise' runs Megatron-Core's FP8 GEMMs in Transformer "
            r"Engine's layers on an FP8 GPU \(compute capability >= 8\.9\); missing here: "
            r"Transformer Engine \(not installed\), an FP8 GPU \(device_type='cpu'\); the engine "
            r"builds Megatron's local \(TE-free\) layer spec",
        ),
        (
            {"fp8_recipe": "delayed"},
            {"te_installed": True, "device_type": "cuda"},
            r"^MegatronEngine: fp8_recipe='delayed' runs .* \(compute capability >= 8\.9\); the "
            r"engine builds Megatron's local \(TE-free\) layer spec, whose linears do not run FP8",
        ),
    ],
)
def test_what_does_not_run_is_refused(
    kwargs: dict[str, Any], where: dict[str, Any], message: str
) -> None:
    at = {"mla": False, "te_installed": False, "device_type": "cpu", **where}
    with pytest.raises(LayoutError, match=message):
        megatron_option_fields(MegatronRunOptions(**kwargs), **at)
