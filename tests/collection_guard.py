"""A guard against tests that silently stop running.

pytest skips folders by name (its default ``norecursedirs`` holds ``dist`` and
``build``), a module-level skip drops a whole file when an import is missing, and a
marker expression or a plugin can deselect a folder. None of that fails a run. With
``--check-collection`` (``make test`` passes it) the run fails unless every test
function defined under ``tests/`` was reported (passed, failed, skipped by a marker,
xfailed): the definitions are read from the source files, independently of pytest's
collection, and compared with the reports, folder by folder.
"""

import ast
import os
from collections.abc import Iterable
from pathlib import Path

import pytest

__all__ = ["defined_tests", "folder_of", "missing_tests", "summary_lines"]


def _test_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(
                    item, ast.FunctionDef | ast.AsyncFunctionDef
                ) and item.name.startswith("test"):
                    names.append(f"{node.name}::{item.name}")
    return names


def defined_tests(root: Path) -> dict[str, list[str]]:
    """``{"tests/laws/test_x.py::test_y": ...}`` grouped by folder, from the source files.

    Every ``test_*.py`` under ``root`` counts, whatever its folder is called.
    """
    base = root.parent
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("test_*.py")):
        if any(part.startswith(".") or part == "__pycache__" for part in path.parts):
            continue
        rel = path.relative_to(base).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in _test_names(tree):
            out.setdefault(folder_of(rel), []).append(f"{rel}::{name}")
    return out


def folder_of(nodeid: str) -> str:
    """``tests/laws/test_x.py::test_y[3]`` -> ``tests/laws`` (``tests`` for top-level files)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def _function_id(nodeid: str) -> str:
    # parameters (``[...]``) and pytest-xdist's group suffix (``@group``) dropped
    return nodeid.split("[", 1)[0].split("@", 1)[0]


def missing_tests(defined: dict[str, list[str]], reported: Iterable[str]) -> dict[str, list[str]]:
    """Defined test functions, by folder, that no report names (parameters ignored)."""
    seen = {_function_id(n) for n in reported}
    out: dict[str, list[str]] = {}
    for folder, names in defined.items():
        gone = [n for n in names if n not in seen]
        if gone:
            out[folder] = gone
    return out


def summary_lines(defined: dict[str, list[str]], reported: Iterable[str]) -> list[str]:
    """One line per folder: test functions defined, functions and items reported."""
    reported = list(reported)
    items: dict[str, int] = {}
    functions: dict[str, set[str]] = {}
    for n in reported:
        items[folder_of(n)] = items.get(folder_of(n), 0) + 1
        functions.setdefault(folder_of(n), set()).add(_function_id(n))
    lines = []
    for folder in sorted(set(defined) | set(items)):
        lines.append(
            f"{folder}: {len(defined.get(folder, []))} test functions defined, "
            f"{len(functions.get(folder, set()))} reported, {items.get(folder, 0)} test items"
        )
    return lines


# -- hooks (re-exported by tests/conftest.py) ------------------------------------------
_REPORTED: set[str] = set()


def _root(config: pytest.Config) -> Path:
    return Path(config.rootpath) / "tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--check-collection",
        action="store_true",
        default=False,
        help="fail the run unless every test function defined under tests/ was reported",
    )


def _guarding(config: pytest.Config) -> bool:
    # only the controlling process judges (an xdist worker sees a share of the tests)
    return bool(config.getoption("--check-collection")) and not os.environ.get(
        "PYTEST_XDIST_WORKER"
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _REPORTED.add(report.nodeid)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if not _guarding(config):
        return
    defined = defined_tests(_root(config))
    terminalreporter.section("collection guard")
    for line in summary_lines(defined, _REPORTED):
        terminalreporter.write_line(line)
    for folder, names in missing_tests(defined, _REPORTED).items():
        terminalreporter.write_line(
            f"NOT RUN in {folder}: {len(names)} test functions, e.g. {names[:3]}", red=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _guarding(session.config):
        return
    if missing_tests(defined_tests(_root(session.config)), _REPORTED) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
