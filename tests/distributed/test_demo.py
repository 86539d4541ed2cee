"""The main job (README's first command) runs and verifies everything it claims."""

import re
from pathlib import Path

import pytest

from areal_fn.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("demo")]


def test_demo_runs_green_and_names_its_artefacts(capsys, tmp_path):
    import json

    workdir = tmp_path / "demo[bold]:cat:"  # printed verbatim, not as rich markup
    rc = main(["demo", "--workdir", str(workdir)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for check in (
        "plan",
        "train fsdp:d2t2",
        "packed Ulysses SP step = one process, one by one",
        "Ulysses SP tokens per rank (cp=2)",
        "train fsdp:d2c2 packed (Ulysses SP)",
        "checkpoint",
        "export HF checkpoint",
        "weight sync",
        "weight sync fsdp:d2t2 -> vLLM t2 (real engine)",
        "weight sync megatron:t2p2 -> vLLM t2 (real engine)",
        "resume megatron:t2p2",
        "megatron logprobs vs trainer",
        "train megatron:t2p2",
        "packed CP step = one process, one by one",
        "CP tokens per rank (cp=2)",
        "train megatron:d2c2 packed (CP)",
    ):
        assert f"[ok] {check}" in out, out
    # the packed phases: mixed lengths packed into rows, each rank half of every row
    assert re.search(
        r"\[ok\] train fsdp:d2c2 packed \(Ulysses SP\): 12 sequences of \d+-\d+ tokens", out
    )
    for what in ("Ulysses SP", "CP"):
        rows = re.search(
            rf"\[ok\] {what} tokens per rank \(cp=2\): step 1, each rank half of every row: "
            r"ranks 0\+1: (\d+) rows, (\d+) tokens each of (\d+) .*; ranks 2\+3: (\d+) rows",
            out,
        )
        assert rows and int(rows[1]) > 1 and 2 * int(rows[2]) == int(rows[3]), out
    assert re.search(r"train megatron:d2c2 packed \(CP\): .* \(= fsdp:d2c2's within ", out)
    assert "FAIL" not in out
    assert "areal_fn demo: verified on CPU/gloo, 4 ranks" in out, out
    checkpoint, hf = workdir / "checkpoints" / "step-00000030", workdir / "hf"
    assert f"artefacts in {workdir}:\n" in out, out
    assert f"  checkpoint  {checkpoint}  (areal-fn checkpoint inspect {checkpoint.parent})" in out
    assert f"  HF export   {hf}  (transformers: AutoModelForCausalLM.from_pretrained)" in out
    assert (checkpoint / "manifest.json").is_file()
    assert json.loads((hf / "config.json").read_text())["model_type"] == "qwen2"


def test_cli_bad_input_is_one_line(capsys):
    assert main(["plan", "Qwen2.5-7B", "megatron:d2t3x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and err[0].startswith("areal-fn: error:"), err  # message, input, caret


@pytest.mark.parametrize("where", ["2:train", "1:sync"])
def test_a_dying_rank_fails_the_job_fast_and_is_named(where, capsys, tmp_path):
    import time

    from areal_fn.runtime.demo.driver import MIN_STEPS, run_demo

    rank = where.split(":")[0]
    start = time.perf_counter()
    rc = run_demo(steps=MIN_STEPS, workdir=tmp_path / "w", fault=where, timeout_s=240)
    took = time.perf_counter() - start
    captured = capsys.readouterr()
    assert rc == 1
    assert f"rank {rank}: injected death" in captured.err, captured.err[-3000:]
    assert "verified on CPU" not in captured.out
    assert took < 180, f"the job took {took:.0f} s to fail"
    assert Path(tmp_path / "w").is_dir()
