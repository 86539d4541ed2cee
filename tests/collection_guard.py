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
from collections.abc import Iterable
from pathlib import Path

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
    return nodeid.split("[", 1)[0]


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
