"""``areal-fn plan CONFIG ALLOCATION --device-memory SIZE``: every rank's estimate is
checked against the memory a device leaves after ``--memory-margin``, and the ranks
that do not fit are named (text and ``--json``); ``--json --png`` writes the pictures
and lists them."""

import json
from pathlib import Path

import pytest

from areal_fn.cli import main
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.memory import estimate_memory


def _out(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_a_plan_that_does_not_fit_names_its_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    out = _out(capsys, ["plan", "Llama-3.1-405B", "megatron:t8", "--device-memory", "80GB"])
    line = next(x for x in out.splitlines() if x.startswith("megatron does not fit"))
    assert line == (
        "megatron does not fit: 8 ranks (0-7) need more than the 72,000,000,000 bytes "
        "(67.1 GiB) usable of 80GB per device after the 10% margin (--memory-margin); peak "
        "850.6 GiB on rank 0; activations not counted: pass --seq-len"
    )


def test_a_plan_that_fits_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "Qwen3-8B", "sglang:t2+megatron:d2t2", "--seq-len", "4096"]
    out = _out(capsys, [*argv, "--device-memory", "80GiB", "--memory-margin", "0.2"])
    fits = [x for x in out.splitlines() if " fits: " in x]
    assert [x.split(" fits: ")[0] for x in fits] == ["sglang", "megatron"]
    assert all(
        "every rank within the 68,719,476,736 bytes (64.0 GiB) usable of 80GiB per device "
        "after the 20% margin (--memory-margin); peak " in x
        for x in fits
    )
    assert "activations not counted" not in out


def test_json_lists_the_ranks_over_and_the_peak(capsys: pytest.CaptureFixture[str]) -> None:
    model = model_from_hf_config("Qwen3-8B")
    report = estimate_memory(layout_for(model, "megatron:p2"))
    # between the two stages' totals: one stage fits, the other does not
    low, high = sorted({r.total for r in report.rows})
    size = f"{(low + high) // 2}B"
    argv = ["plan", "Qwen3-8B", "sglang:t2+megatron:p2", "--device-memory", size, "--json"]
    doc = json.loads(_out(capsys, [*argv, "--memory-margin", "0"]))
    infer, train = doc["components"]
    assert infer["fit"]["fits"] is True and infer["fit"]["ranks_over"] == []
    over = [2 + r.rank for r in report.rows if r.total > (low + high) // 2]
    assert train["fit"] == {
        "device_memory_bytes": (low + high) // 2,
        "memory_margin": 0.0,
        "usable_bytes": (low + high) // 2,
        "fits": False,
        "peak_rank": 2 + report.max_rank.rank,
        "peak_bytes": high,
        "ranks_over": over,
        "activations_counted": False,
    }
    assert over and len(over) < 2


def test_without_device_memory_fit_is_null(capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(_out(capsys, ["plan", "demo", "megatron:t2", "--json"]))
    assert doc["components"][0]["fit"] is None


def test_json_and_png_together_write_the_pictures_and_list_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pics = tmp_path / "pics"
    doc = json.loads(_out(capsys, ["plan", "demo", "megatron:p2", "--json", "--png", str(pics)]))
    listed = doc["components"][0]["pictures"]
    assert listed == [str(pics / f"megatron-d1p2.{kind}.png") for kind in ("ranks", "stages")]
    assert all(Path(p).stat().st_size > 0 for p in listed)


def test_the_text_memory_table_numbers_ranks_as_the_json_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A training component after an inference one: its rows start at its first global
    rank, in the text table as in ``--json`` (and the pictures)."""
    argv = ["plan", "Qwen3-8B", "sglang:d2t2+megatron:d2p2"]
    doc = json.loads(_out(capsys, [*argv, "--json"]))
    megatron = next(c for c in doc["components"] if c["backend"] == "megatron")
    ranks = [r["rank"] for r in megatron["memory"]["per_rank"]]
    assert ranks == list(range(4, 8)) and megatron["first_rank"] == 4
    text = _out(capsys, argv)
    table = text[text.index("MemoryReport megatron") :].splitlines()
    labels = [line.split()[0] for line in table[2:] if line[:1].isdigit()]
    assert labels and all(int(x.split("-")[0]) >= 4 for x in labels), table
    covered = [r for x in labels for r in range(int(x.split("-")[0]), int(x.split("-")[-1]) + 1)]
    assert covered == ranks
    assert f"max: rank {megatron['memory']['max_rank']}," in text
