"""Rows of a given length must split as the training engines split them under ``c``.

``check_strategy(..., seq_len=)`` and ``areal-fn plan CONFIG ALLOCATION --seq-len N``
refuse a length that Megatron's context parallelism (``2 * cp`` equal chunks) or
FSDP2's Ulysses sequence parallelism (``cp`` equal parts) cannot split, with the
numbers and the remedy; with ``--seq-len`` the plan's training memory counts the
activations of rows of that length.
"""

import json

import pytest

from areal_fn.cli import main
from areal_fn.errors import LayoutError
from areal_fn.model.embedded import resolve_config
from areal_fn.model.spec import model_from_hf_config
from areal_fn.strategy.check import check_strategy

MODEL = model_from_hf_config(resolve_config("Qwen3-8B"))


@pytest.mark.parametrize(
    ("alloc", "seq_len", "message"),
    [
        (
            "megatron:d2c3",
            32768,
            r"megatron \(megatron:d2c3\): sequence length 32768 does not split into 2\*cp=6 "
            r"equal chunks .*pass rows of a multiple of 6 tokens \(e\.g\. 32772",
        ),
        (
            "megatron:c4",
            4100,
            r"sequence length 4100 does not split into 2\*cp=8 equal chunks",
        ),
        (
            "fsdp:d2c4",
            4098,
            r"fsdp \(fsdp:d2c4\): sequence length 4098 does not split into cp=4 equal parts "
            r"\(Ulysses .*multiple of 4 tokens \(e\.g\. 4100",
        ),
        (
            "sglang:t2+megatron:d1c2",
            30,
            r"megatron \(megatron:d1c2\): sequence length 30 does not split into 2\*cp=4",
        ),
        ("megatron:d2", 0, r"sequence length 0 must be >= 1"),
    ],
)
def test_rows_that_the_engines_cannot_split_are_refused(alloc, seq_len, message):
    with pytest.raises(LayoutError, match=message):
        check_strategy(MODEL, alloc, seq_len=seq_len)


@pytest.mark.parametrize(
    ("alloc", "seq_len"),
    [
        ("megatron:d2c4", 32768),
        ("megatron:c2", 4),  # one token per chunk
        ("fsdp:d2c2", 4098),  # Ulysses needs a multiple of cp, not of 2*cp
        ("megatron:d2c3", None),  # without a length nothing about rows is checked
        ("sglang:d2t2", 7),  # inference engines do not split rows
        ("megatron:d4", 1001),
    ],
)
def test_rows_that_split_pass(alloc, seq_len):
    check_strategy(MODEL, alloc, seq_len=seq_len)


def test_the_plan_command_refuses_them_in_its_own_words(capsys):
    assert main(["plan", "Qwen3-8B", "megatron:d2c3", "--seq-len", "32768"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal-fn: error: megatron (megatron:d2c3): sequence length 32768")
    assert "Traceback" not in err
    assert main(["plan", "Qwen3-8B", "megatron:d2", "--seq-len", "-5"]) == 2
    assert "--seq-len -5 must be >= 1" in capsys.readouterr().err


def _activations(capsys, alloc: str, seq_len: int | None) -> list[int]:
    argv = ["plan", "Qwen3-8B", alloc, "--json"]
    if seq_len is not None:
        argv += ["--seq-len", str(seq_len), "--no-recompute"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    (comp,) = doc["components"]
    return [r["activations"] for r in comp["memory"]["per_rank"]]


def test_with_a_length_the_plan_counts_activations_per_rank_of_their_tokens(capsys):
    # without --seq-len the plan counts no activations
    assert set(_activations(capsys, "megatron:d2c2", None)) == {0}
    # context parallelism gives each rank T/cp tokens of every row: a rank of c2 at T
    # holds what a rank of c1 holds at T/2 (balanced chunks, same per-token bytes)
    c2 = _activations(capsys, "megatron:d2c2", 16384)
    c1_half = _activations(capsys, "megatron:d2", 8192)
    assert set(c2) == set(c1_half) and min(c2) > 0
    c1 = _activations(capsys, "megatron:d2", 16384)
    assert 1.9 < max(c1) / max(c2) <= 2.0
