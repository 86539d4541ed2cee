"""The collection guard fails a run in which defined tests did not run."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.collection_guard import defined_tests, folder_of, missing_tests

REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
from tests.collection_guard import (
    pytest_addoption, pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary,
)
"""


def _tree(root: Path, *, ini: str) -> None:
    (root / "pytest.ini").write_text(ini)
    (root / "tests").mkdir()
    (root / "tests" / "conftest.py").write_text(CONFTEST)
    for folder, body in {
        "laws": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
        "dist": "import pytest\n\n@pytest.mark.parametrize('x', [1, 2])\ndef test_c(x):\n    pass\n",
        "oracles": "import pytest\npytest.importorskip('no_such_module_here')\n\ndef test_d():\n    pass\n",
    }.items():
        (root / "tests" / folder).mkdir()
        (root / "tests" / folder / f"test_{folder}.py").write_text(body)


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, "tests"],
        cwd=root,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_skipped_folder_and_a_skipped_module_fail_the_guarded_run(tmp_path: Path) -> None:
    _tree(tmp_path, ini="[pytest]\n")  # pytest's default norecursedirs skips tests/dist
    plain = _run(tmp_path)
    assert plain.returncode == 0, plain.stdout  # the trap: green, though 3 tests never ran
    guarded = _run(tmp_path, "--check-collection")
    assert guarded.returncode == 1, guarded.stdout
    assert "NOT RUN in tests/dist: 1 test functions" in guarded.stdout
    assert "NOT RUN in tests/oracles: 1 test functions" in guarded.stdout
    assert "tests/laws: 2 test functions defined, 2 reported, 2 test items" in guarded.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadgroup"]], ids=["1", "xdist"])
def test_the_guard_passes_when_everything_ran(tmp_path: Path, workers: list[str]) -> None:
    _tree(tmp_path, ini="[pytest]\nnorecursedirs = .* __pycache__\n")
    (tmp_path / "tests" / "oracles" / "test_oracles.py").write_text(
        "import pytest\n\n@pytest.mark.xdist_group('g')\ndef test_d():\n    pass\n"
    )
    guarded = _run(tmp_path, "--check-collection", *workers)
    assert guarded.returncode == 0, guarded.stdout
    assert "tests/dist: 1 test functions defined, 1 reported, 2 test items" in guarded.stdout


def test_definitions_are_read_from_the_source(tmp_path: Path) -> None:
    (tmp_path / "tests" / "x").mkdir(parents=True)
    (tmp_path / "tests" / "x" / "test_m.py").write_text(
        textwrap.dedent(
            """
            def test_f(): pass
            def helper(): pass
            class TestK:
                def test_g(self): pass
                def other(self): pass
            """
        )
    )
    defined = defined_tests(tmp_path / "tests")
    assert defined == {"tests/x": ["tests/x/test_m.py::test_f", "tests/x/test_m.py::TestK::test_g"]}
    assert folder_of("tests/x/test_m.py::test_f[1-2]") == "tests/x"
    assert folder_of("tests/test_top.py::test_f") == "tests"
    assert missing_tests(defined, ["tests/x/test_m.py::TestK::test_g@group"]) == {
        "tests/x": ["tests/x/test_m.py::test_f"]
    }
    assert missing_tests(defined, ["tests/x/test_m.py::test_f[3]@group"]) == {
        "tests/x": ["tests/x/test_m.py::TestK::test_g"]
    }


@pytest.mark.parametrize("folder", ["laws", "oracles", "invalid", "distributed"])
def test_every_folder_of_this_repository_defines_tests(folder: str) -> None:
    assert defined_tests(REPO / "tests").get(f"tests/{folder}"), folder


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    """``--dist loadgroup`` keeps each ``xdist_group`` on one worker (the torchrun tests
    share one launch per group through module fixtures). pytest 9.2 with pytest-xdist
    3.8 silently spreads a group over the workers; constraints.txt keeps pytest below."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests").mkdir()
    body = ["import os", "import pytest", "", "pytestmark = [pytest.mark.xdist_group('g')]", ""]
    for i in range(6):
        body += [
            f"def test_{i}(tmp_path_factory):",
            f"    with open({str(tmp_path / 'workers.txt')!r}, 'a') as f:",
            "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')",
            "",
        ]
    (tmp_path / "tests" / "test_g.py").write_text("\n".join(body))
    (tmp_path / "tests" / "test_free.py").write_text(
        "\n".join(f"def test_free_{i}():\n    pass\n" for i in range(6))
    )
    run = _run(tmp_path, "-n", "2", "--dist", "loadgroup")
    assert run.returncode == 0, run.stdout
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers
