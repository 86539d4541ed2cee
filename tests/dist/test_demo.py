"""The main job (README's first command) runs and verifies everything it claims."""

import pytest

from areal_fn.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("demo")]


def test_demo_runs_green(capsys, tmp_path):
    from areal_fn.runtime.demo import run_demo

    rc = run_demo(nproc=4, steps=30, out=str(tmp_path))
    out = capsys.readouterr().out
    assert rc == 0, out
    for check in (
        "plan",
        "train fsdp:d2t2",
        "checkpoint",
        "weight sync",
        "resume megatron:t2p2",
        "megatron logprobs vs trainer",
        "train megatron:t2p2",
    ):
        assert f"[ok] {check}" in out, out
    assert "FAIL" not in out


def test_cli_bad_input_is_one_line(capsys):
    assert main(["plan", "Qwen2.5-7B", "megatron:d2t3x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and err[0].startswith("areal-fn: error:"), err  # message, input, caret
    assert main(["demo", "--nproc", "3"]) == 2
