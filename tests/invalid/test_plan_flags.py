"""``areal-fn plan`` (and ``checkpoint inspect --tensors``): every flag works as written
or is refused in one line naming the flag, the value, the rule and the remedy (exit 2,
nothing written); sizes beyond plan's limit are refused at once, sizes within it answer
in seconds."""

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_fn.cli import main
from areal_fn.runtime.commands.plan_flags import MAX_PLAN_RANKS

LIMIT = (
    r"ranks, more than plan's limit of 16384 \(2\*\*14\): plan estimates every rank's memory, "
    r"which takes minutes beyond that; plan at most 16384 ranks, or call "
    r"areal_fn\.plans\.memory\.estimate_memory from Python \(no limit\)$"
)
SUGGEST = ["--suggest", "8", "--device-memory", "80GB"]

FLOAT8 = r"--float8-recipe rowwise counts torchao's float8 training, which runs in the FSDP2 engine"

#: (argv after ``plan``, the message after ``areal-fn: error: ``)
REFUSED = [
    (
        ["demo", "fsdp:d2t2", "--float8-recipe", "rowwise"],
        FLOAT8 + r"; with tp=2 \(fsdp:d2t2\) it needs torchao's float8 TP styles, which the "
        r"engine's TP plan does not use: use t1, or drop --float8-recipe rowwise$",
    ),
    (
        ["demo", "fsdp:d2+megatron:d2", "--float8-recipe", "rowwise"],
        FLOAT8 + r"; megatron:d2 is megatron, whose engine refuses every fp8_recipe \(Transformer "
        r"Engine's FP8 needs its layer spec and an FP8 GPU\): plan fsdp components only, or "
        r"drop --float8-recipe rowwise$",
    ),
    (
        ["demo", "vllm:t2", "--float8-recipe", "rowwise"],
        FLOAT8 + r"; vllm:d1t2 has no fsdp component: drop --float8-recipe rowwise$",
    ),
    (
        ["demo", "fsdp:d2", "--float8-recipe", "rowwise", "--lora-rank", "4"],
        FLOAT8 + r" over plain fp32 linear layers, not with LoRA adapters \(--lora-rank\): drop "
        r"one of them$",
    ),
    (
        ["demo", "fsdp:d2", "--float8-recipe", "rowwise", "--precision", "bf16"],
        FLOAT8 + r" over plain fp32 linear layers \(fp32 parameters, gradients and Adam states\), "
        r"not under --precision bf16: drop --precision \(fp32 is counted\)$",
    ),
    (
        ["demo", *SUGGEST, "--float8-recipe", "rowwise"],
        r"--float8-recipe applies to plan of an ALLOCATION; --suggest does not use it: drop it$",
    ),
    (
        ["Qwen3-8B", "--suggest", "1000000000000000000000", "--device-memory", "80GB"],
        r"--suggest 1000000000000000000000 asks for 1000000000000000000000 " + LIMIT,
    ),
    (["Qwen3-8B", "--suggest", "16385", "--device-memory", "80GB"], r"--suggest 16385 asks for "),
    (["Qwen3-8B", "fsdp:d1048576"], r"ALLOCATION fsdp:d1048576 has 1048576 " + LIMIT),
    (["Qwen3-8B", "sglang:d8t4+fsdp:d16384"], r"ALLOCATION sglang:d8t4\+fsdp:d16384 has 16416 "),
    (
        ["Qwen3-8B", "--suggest", "0"],
        r"--suggest 0 must be >= 1: the number of devices to rank training strategies for$",
    ),
    (["Qwen3-8B", "--suggest", "-3", "--device-memory", "80GB"], r"--suggest -3 must be >= 1"),
    (
        ["Qwen3-8B", "megatron:t2", *SUGGEST],
        r"--suggest ranks strategies of its own and does not plan the ALLOCATION megatron:t2: "
        r"drop megatron:t2, or drop --suggest to plan it$",
    ),
    (
        ["Qwen3-8B", "megatron:t2", "--tensors", "-1"],
        r"--tensors -1 must be >= 0: how many tensors to list \(0: none\)$",
    ),
    (
        ["demo", "vllm:d2t2", "--seq-len", "1"],
        r"--seq-len shapes a training component's activations; vllm:d2t2 has none: drop "
        r"--seq-len \(--context-len and --batch size the KV cache of inference components\)$",
    ),
    (
        ["demo", "sglang:t2", "--seq-len", "64", "--micro-batch", "2"],
        r"--micro-batch shapes a training component's activations; sglang:d1t2 has none",
    ),
    (["demo", "sglang:t2", "--batch", "0"], r"--batch 0 must be >= 1: sequences per engine"),
    (["demo", "sglang:t2", "--context-len", "-1"], r"--context-len -1 must be >= 1: tokens per"),
    (["demo", *SUGGEST, "--top", "0"], r"--top 0 must be >= 1: how many suggestions to show$"),
    (
        ["demo", "megatron:t2", "--top", "3"],
        r"--top applies to --suggest N; plan of an ALLOCATION does not use it: drop it, or pass "
        r"--suggest N instead of the ALLOCATION$",
    ),
    (["demo", "megatron:t2", "--optimizer-offload"], r"--optimizer-offload applies to --suggest"),
    (["demo", "megatron:t2", "--adam-dtype", "bf16"], r"--adam-dtype applies to --suggest N;"),
    (["demo", "megatron:t2", "--global-batch", "64"], r"--global-batch applies to --suggest N;"),
    (
        ["demo", "megatron:t2", "--no-recompute"],
        r"--no-recompute shapes the activations, which plan of an ALLOCATION counts only with "
        r"--seq-len: pass --seq-len N, or drop --no-recompute$",
    ),
    (["demo", "megatron:t2", "--micro-batch", "2"], r"--micro-batch shapes the activations"),
    (
        ["demo", *SUGGEST, "--tensors", "3"],
        r"--tensors applies to plan of an ALLOCATION; --suggest does not use it: drop it$",
    ),
    (["demo", *SUGGEST, "--context-len", "8"], r"--context-len applies to plan of an ALLOCATION"),
    (
        ["demo", "megatron:t2", "--memory-margin", "0.2"],
        r"--memory-margin is the fraction of --device-memory kept free; pass --device-memory "
        r"SIZE, or drop --memory-margin$",
    ),
    (
        ["demo", "megatron:t2", "--context-len", "8"],
        r"--context-len applies to inference components \(sglang, vllm\); megatron:d1t2 has none: "
        r"drop --context-len$",
    ),
    (
        ["demo", "sglang:t2", "--json", "--max-ranks", "3"],
        r"--max-ranks sets the rows of the text tables; --json lists every rank: drop "
        r"--max-ranks$",
    ),
    (
        ["demo", "megatron:t2", "--device-memory", "80GB", "--memory-margin", "1"],
        r"--memory-margin 1\.0 must be in \[0, 1\): the fraction of device memory kept free",
    ),
    (["demo", "megatron:t2", "--device-memory", "80"], r"--device-memory '80' has no unit;"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED)
def test_refused_at_once_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.perf_counter()
    assert main(["plan", *argv]) == 2
    assert time.perf_counter() - start < 10
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and err.startswith("areal-fn: error: ")
    assert re.search(message, err.removeprefix("areal-fn: error: ")), err


def test_a_refused_flag_writes_no_pictures(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pics = tmp_path / "pics"
    assert main(["plan", "demo", "megatron:t2", "--top", "2", "--png", str(pics)]) == 2
    assert "--top applies to --suggest N" in capsys.readouterr().err
    assert not pics.exists()


def _cpu_seconds_of(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``areal-fn ARGV`` in a fresh interpreter; its result and the CPU seconds it took
    (user + system: the machine's load does not count)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = "import sys; from areal_fn.cli import main; sys.exit(main())"
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "COLUMNS": "200"},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "Qwen3-8B", f"fsdp:d{MAX_PLAN_RANKS}", "--json"],
        ["plan", "Qwen3-8B", f"sglang:d{MAX_PLAN_RANKS // 8}t8", "--json"],
        ["plan", "Qwen3-8B", "--suggest", str(MAX_PLAN_RANKS), "--device-memory", "80GB"],
    ],
)
def test_the_largest_size_plan_takes_answers_in_seconds(argv: list[str]) -> None:
    proc, cpu = _cpu_seconds_of(argv)
    assert proc.returncode == 0, proc.stderr
    assert cpu < 10, f"{cpu:.1f} s of CPU for {argv}"
    if "--json" in argv:
        assert json.loads(proc.stdout)["world_size"] == MAX_PLAN_RANKS


def test_checkpoint_inspect_refuses_a_negative_tensors_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoint", "inspect", str(tmp_path), "--tensors", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "areal-fn: error: --tensors -1 must be >= 0: how many tensors to list"
