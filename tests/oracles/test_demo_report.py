"""What ``areal-fn demo`` tells the user at the end, checked without torchrun: where the
artefacts are (a chosen ``--workdir`` or a kept temporary directory), and a title that
says "verified" only when every check ran and passed."""

from pathlib import Path

import pytest

from areal_fn.cli import main
from areal_fn.runtime.demo import driver as demo
from areal_fn.runtime.launch import LaunchResult


def _fake_launch(monkeypatch: pytest.MonkeyPatch, *, ok: bool = True, write: bool = True) -> list:
    seen: list = []

    def run_torchrun(script, args, *, nproc, timeout_s, env, check):
        workdir = Path(args[args.index("--workdir") + 1])
        seen.append((nproc, workdir))
        if write:
            step = workdir / "checkpoints" / "step-00000030"
            step.mkdir(parents=True)
            (workdir / "checkpoints" / "latest").write_text("step-00000030\n")
            (workdir / "hf").mkdir()
        return LaunchResult(
            command=("torchrun",),
            returncode=0 if ok else 1,
            timed_out=False,
            duration_s=1.0,
            output="",
            rank_stdout=("the table\n", "", "", ""),
            rank_stderr=("", "Traceback: boom", "", ""),
        )

    monkeypatch.setattr(demo, "run_torchrun", run_torchrun)
    monkeypatch.setattr(demo, "VllmServer", _NoServer)
    monkeypatch.setattr(demo, "write_served_model", lambda path, config: path)
    return seen


class _NoServer:
    """The vLLM server the driver starts, left out here (the torchrun test runs it)."""

    def __init__(self, model, *, secret, log):
        self.url = "http://127.0.0.1:9"
        log.write_text("")

    def stop(self):
        pass


def test_artefacts_are_printed_where_the_user_put_them(monkeypatch, tmp_path, capsys):
    seen = _fake_launch(monkeypatch)
    workdir = tmp_path / "runs[bold]" / "w:cat:"
    assert main(["demo", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert seen == [(4, workdir)]
    assert out.startswith("the table\n")
    assert f"artefacts in {workdir}:\n" in out, out
    assert f"  checkpoint  {workdir}/checkpoints/step-00000030" in out, out
    assert f"  HF export   {workdir}/hf " in out, out


def test_without_workdir_a_temporary_directory_is_kept_and_named(monkeypatch, capsys):
    seen = _fake_launch(monkeypatch)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    ((_, workdir),) = seen
    try:
        assert workdir.name.startswith("areal_fn_demo_") and (workdir / "hf").is_dir()
        assert (
            f"artefacts in {workdir} (a new temporary directory, kept: remove it when done" in out
        )
        assert f"  HF export   {workdir}/hf " in out, out
    finally:
        import shutil

        shutil.rmtree(workdir)


def test_a_failed_run_still_says_where_its_artefacts_are(monkeypatch, tmp_path, capsys):
    _fake_launch(monkeypatch, ok=False)
    assert main(["demo", "--workdir", str(tmp_path / "w")]) == 1
    captured = capsys.readouterr()
    assert f"  checkpoint  {tmp_path}/w/checkpoints/step-00000030" in captured.out
    assert "areal-fn demo: error: the job failed (ranks [1])" in captured.err


def test_an_empty_temporary_directory_is_removed_and_said(monkeypatch, capsys):
    seen = _fake_launch(monkeypatch, ok=False, write=False)
    assert main(["demo"]) == 1
    ((_, workdir),) = seen
    assert not workdir.exists()
    assert f"no artefacts were written; removed {workdir}" in capsys.readouterr().out


def _title(results, *, complete):
    from areal_fn.runtime.demo.worker import summary_title

    return summary_title(results, complete=complete, seconds=1.5)


def test_title_says_verified_only_when_every_check_ran_and_passed():
    ok = [("plan", True, ""), ("train fsdp:d2t2", True, "")]
    assert _title(ok, complete=True) == "areal_fn demo: verified on CPU/gloo, 4 ranks, 1.5 s"
    bad = [("plan", True, ""), ("train fsdp:d2t2", False, "")]
    assert _title(bad, complete=True) == (
        "areal_fn demo: FAILED 1 of 2 checks (train fsdp:d2t2) on CPU/gloo, 4 ranks, 1.5 s"
    )
    assert _title(ok, complete=False) == (
        "areal_fn demo: NOT verified, stopped after 'train fsdp:d2t2' (see the error report) "
        "on CPU/gloo, 4 ranks, 1.5 s"
    )
    assert "verified" not in _title(bad, complete=False).replace("NOT verified", "")
    assert _title([], complete=False).startswith(
        "areal_fn demo: NOT verified, stopped before the first check"
    )
