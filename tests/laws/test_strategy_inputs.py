"""What users pass as a strategy and a model: every spelling means one value.

An allocation string, a parsed ``Allocation`` of one component and a ``Component``
give the layouts, ``check_strategy`` and ``estimate_memory`` exactly what its
``ParallelDims`` gives; the HSDP spelling ``fsdp:d2x4`` gives the layout that
``Fsdp2Options(hsdp_replicas=2)`` gives (itself checked against FSDP2 in
tests/distributed/test_fsdp2_placements.py); a model name in any case, or as an HF
repo id, is the embedded config file.
"""

import json
from pathlib import Path

import pytest

from areal_fn import (
    ParallelDims,
    check_strategy,
    estimate_memory,
    fsdp2_layout,
    inference_layout,
    megatron_layout,
    model_from_hf_config,
    parse_allocation,
)
from areal_fn.layouts.fsdp2 import Fsdp2Options
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.embedded import embedded_names, match_name
from areal_fn.plans.advisor.census import census_of, fsdp2_census
from areal_fn.plans.memory import estimate_rows
from areal_fn.plans.memory.activations import ActivationModel

# four heads (tp up to 4); the demo model itself has two
MODEL = model_from_hf_config(dict(DEMO_CONFIG, num_attention_heads=4))
SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"


def _spellings(text: str) -> list[object]:
    a = parse_allocation(text)
    return [text, a, a.components[0], f"  {text.replace(':', ' : ')} "]


@pytest.mark.parametrize(
    ("build", "text", "dims"),
    [
        (fsdp2_layout, "fsdp:d2t2", ParallelDims(dp=2, tp=2)),
        (fsdp2_layout, "fsdp[actor]:d4", ParallelDims(dp=4)),
        (megatron_layout, "megatron:t2p2", ParallelDims(tp=2, pp=2)),
        (megatron_layout, "megatron[actor]:d2t2", ParallelDims(dp=2, tp=2)),
        (inference_layout, "sglang:d2t2", ParallelDims(dp=2, tp=2)),
        (inference_layout, "vllm:t4", ParallelDims(tp=4)),
    ],
)
def test_layouts_take_an_allocation_string_or_component(build, text, dims) -> None:
    want = build(MODEL, dims)
    for given in _spellings(text):
        assert build(MODEL, given) == want
    assert layout_for(MODEL, text) == want


def test_hsdp_spelling_is_the_hsdp_option() -> None:
    want = fsdp2_layout(MODEL, ParallelDims(dp=8), options=Fsdp2Options(hsdp_replicas=2))
    assert want.meshes[0].shape == {"dp_replicate": 2, "dp_shard": 4}
    dims = parse_allocation("fsdp:d2x4").training.dims
    assert dims == ParallelDims(dp=8, dp_replicate=2) and dims.dp_shard == 4
    assert fsdp2_layout(MODEL, dims) == want
    assert fsdp2_layout(MODEL, "fsdp:d2x4") == want
    # the option given again, equal, is the same layout
    assert fsdp2_layout(MODEL, dims, options=Fsdp2Options(hsdp_replicas=2)) == want
    assert layout_for(MODEL, parse_allocation("fsdp:d2x4").training) == want
    assert fsdp2_census(MODEL, dims) == census_of(want)
    with_tp = fsdp2_layout(MODEL, "fsdp:d2x2t2c2")
    assert with_tp.meshes[0].shape == {"dp_replicate": 2, "dp_shard": 4, "tp": 2}
    assert with_tp == fsdp2_layout(
        MODEL, ParallelDims(dp=4, tp=2, cp=2), options=Fsdp2Options(hsdp_replicas=2)
    )


def test_check_strategy_takes_a_string_or_component() -> None:
    for given in ("sglang:d2t2+megatron:t2p2", parse_allocation("fsdp:d2x2").training):
        check_strategy(MODEL, given)
    check_strategy(MODEL, "fsdp : d4", n_devices=4)


def test_estimate_memory_takes_the_dims_as_a_string() -> None:
    layout = megatron_layout(MODEL, "megatron:d2t2p2")
    act = ActivationModel(micro_batch_size=2, seq_len=64)
    want = estimate_memory(layout, activation=act, model=MODEL, dims=ParallelDims(dp=2, tp=2, pp=2))
    assert want.max_rank.activations > 0
    for given in _spellings("megatron:d2t2p2"):
        assert estimate_memory(layout, activation=act, model=MODEL, dims=given) == want
        rows = estimate_rows(layout, [0, 7], activation=act, model=MODEL, dims=given)
        assert rows == (want.rows[0], want.rows[7])


# -- model names -----------------------------------------------------------------------


def test_every_embedded_config_is_listed() -> None:
    assert embedded_names() == ("demo", *sorted(p.stem for p in SPECS.glob("*.json")))


@pytest.mark.parametrize("given", ["Qwen2.5-7B", "qwen2.5-7b", "QWEN2.5-7B", "Qwen/Qwen2.5-7B"])
def test_a_name_in_any_case_is_the_embedded_file(given: str) -> None:
    want = model_from_hf_config(json.loads((SPECS / "Qwen2.5-7B.json").read_text()))
    assert model_from_hf_config(given) == want


def test_demo_is_a_name_too() -> None:
    assert (
        model_from_hf_config("demo")
        == model_from_hf_config("Demo")
        == model_from_hf_config(DEMO_CONFIG)
    )


def test_match_name() -> None:
    names = ("demo", "Llama-3.1-8B", "Qwen2.5-7B")
    assert match_name("meta-llama/llama-3.1-8b", names) == "Llama-3.1-8B"
    assert match_name(" qwen2.5-7b ", names) == "Qwen2.5-7B"
    assert match_name("Qwen2.5-7B-Instruct", names) is None
    assert match_name("a/b/Qwen2.5-7B", names) is None  # a path, not a repo id


def test_an_existing_path_wins_over_a_name(tmp_path: Path, monkeypatch) -> None:
    cfg = dict(DEMO_CONFIG, num_hidden_layers=2)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    assert model_from_hf_config("demo").num_layers == 2
