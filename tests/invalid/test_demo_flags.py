"""``areal-fn demo`` refuses bad flags before anything starts: one line, exit 2, no launch."""

import re

import pytest

from areal_fn.cli import main
from areal_fn.runtime.demo import driver as demo


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def launched(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("torchrun was started for bad flags")

    monkeypatch.setattr(demo, "run_torchrun", launched)


STEPS = (
    r"--steps {n} is too few: the demo checks that training lowers the loss by 20%, "
    r"which takes at least 20 steps; pass --steps 20 or more \(the default is 30\)"
)

CASES = [
    ("no steps", ["--steps", "0"], STEPS.format(n=0)),
    ("negative steps", ["--steps", "-1"], STEPS.format(n=-1)),
    ("too few steps", ["--steps", "19"], STEPS.format(n=19)),
    (
        "workdir is a file",
        ["--workdir", "{tmp}/file"],
        r"--workdir .*/file is a file; the demo writes its checkpoint and HF export into a "
        r"directory: pass a new or empty directory",
    ),
    (
        "workdir not empty",
        ["--workdir", "{tmp}"],
        r"--workdir .* is not empty \(it holds file\); the demo writes a new checkpoint and "
        r"HF export there: pass a new or empty directory, or remove what it holds",
    ),
]


@pytest.mark.parametrize(("what", "argv", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_demo_flag_is_one_line(what, argv, message, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert re.fullmatch("areal-fn: error: " + message, lines[0]), lines[0]
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_nproc_is_gone_the_demo_always_runs_four_processes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--nproc", "4"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --nproc 4" in capsys.readouterr().err


def test_api_refuses_the_same_flags_before_launching(tmp_path):
    from areal_fn.errors import SpecError

    with pytest.raises(SpecError, match=STEPS.format(n=0)):
        demo.run_demo(steps=0, workdir=str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
