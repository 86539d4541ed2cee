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
        "export HF checkpoint",
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


@pytest.mark.parametrize("where", ["2:train", "1:sync"])
def test_a_dying_rank_fails_the_job_fast_and_is_named(where, capsys, tmp_path):
    import time

    from areal_fn.runtime.demo import run_demo

    rank = where.split(":")[0]
    start = time.perf_counter()
    rc = run_demo(nproc=4, steps=6, out=str(tmp_path), fault=where, timeout_s=240)
    took = time.perf_counter() - start
    err = capsys.readouterr().err
    assert rc == 1
    assert f"rank {rank}: injected death" in err, err[-3000:]
    assert took < 180, f"the job took {took:.0f} s to fail"
