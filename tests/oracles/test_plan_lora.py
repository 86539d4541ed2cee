"""``areal-fn plan ... --lora-rank R``: LoRA training's memory (a frozen base, trained
adapters) where full fine-tuning does not fit, for an ALLOCATION and with ``--suggest``;
the expected bytes computed here from the published config's shapes alone
(``r * (in + out)`` per targeted module)."""

import json

import pytest

from areal_fn.cli import main
from tests.laws.test_lora_memory import _qwen3_8b_counts


def _out(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err.strip()


def test_qwen3_8b_fits_one_80gb_device_with_lora_only(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "Qwen3-8B", "fsdp:d1", "--device-memory", "80GB", "--json"]
    full = json.loads(_out(capsys, argv))["components"][0]
    lora = json.loads(_out(capsys, [*argv, "--lora-rank", "32"]))["components"][0]
    assert not full["fit"]["fits"] and lora["fit"]["fits"]
    assert full["memory"]["lora"] is None
    base_n, lora_n, lora_t = _qwen3_8b_counts(32)
    (row,) = lora["memory"]["per_rank"]
    # FSDP2 keeps fp32 sharded parameters (bf16 in flight only); AdamW steps them
    assert row["params"] == 4 * (base_n + lora_n)
    assert row["grads"] == 4 * lora_n
    assert row["optimizer"] == 8 * lora_n + 4 * lora_t
    assert lora["memory"]["lora"] == {
        "rank": 32,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "adapter_params": lora_n,
    }
    text = _out(capsys, argv[:-1] + ["--lora-rank", "32"])
    assert f"{lora_n:,} adapter parameters trained" in text and "fsdp fits: " in text


def test_suggest_with_lora(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "Qwen3-8B", "--suggest", "1", "--device-memory", "80GB", "--seq-len", "2048"]
    assert "no strategy" in _error(capsys, argv)
    doc = json.loads(_out(capsys, [*argv, "--lora-rank", "32", "--json"]))
    _, lora_n, _ = _qwen3_8b_counts(32)
    assert doc["assumptions"]["lora"]["adapter_params"] == lora_n
    assert doc["suggestions"] and all(s["grads"] == 4 * lora_n for s in doc["suggestions"])
    text = _out(capsys, [*argv, "--lora-rank", "32"])
    assert "LoRA rank 32 (--lora-rank)" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["Qwen3-8B", "sglang:t2", "--lora-rank", "8"],
            "--lora-rank counts the LoRA training of a training component (fsdp, megatron); "
            "sglang:d1t2 has none: drop --lora-rank",
        ),
        (["Qwen3-8B", "fsdp:d1", "--lora-rank", "0"], "--lora-rank 0 must be >= 1"),
        (
            ["Qwen3-8B", "fsdp:d1", "--lora-rank", "2000"],
            "--lora-rank 2000 is above 1024, the smallest dimension of a layer it adapts in "
            "qwen3; use --lora-rank in 1..1024",
        ),
    ],
)
def test_refusals(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in _error(capsys, ["plan", *argv])
