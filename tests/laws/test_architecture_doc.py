"""docs/architecture.md lists every module of the package as it is: each module's name
appears, in backticks, in the row of its package (``model/``, ``runtime/hf/``, ...;
the top-level modules in the ``base`` and ``cli`` rows; ``model/families/`` is listed as
one entry, a module per family)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `?(?P<key>[\w/]+)`? \| (?P<modules>[^|]*)\|", re.M)


def _rows() -> dict[str, str]:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    return {m["key"]: m["modules"] for m in ROW.finditer(doc)}


def _modules() -> list[tuple[str, str]]:
    """(package row key, module name) of every module but ``__init__`` and the families."""
    out = []
    for path in sorted((ROOT / "areal_fn").rglob("*.py")):
        parts = path.relative_to(ROOT / "areal_fn").parts
        if path.name == "__init__.py" or parts[:2] == ("model", "families"):
            continue
        package = "/".join(parts[:-1]) + "/" if len(parts) > 1 else ""
        key = package or ("cli" if path.stem == "cli" else "base")
        out.append((key, path.stem))
    return out


def test_every_module_is_in_its_package_row() -> None:
    rows = _rows()
    missing = [f"{key}{stem}" for key, stem in _modules() if f"`{stem}`" not in rows.get(key, "")]
    assert missing == [], f"modules docs/architecture.md does not list in their row: {missing}"


def _outside_parentheses(text: str) -> str:
    """``text`` without what its (nested) parentheses hold: the names of modules, not the
    symbols each module's description names."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def test_every_listed_module_exists() -> None:
    """A row names only modules that exist (no stale names after a rename)."""
    present = set(_modules())
    packages = {key for key, _ in present}
    stale = []
    for key, modules in _rows().items():
        if key not in packages:
            continue
        for name in re.findall(r"`(\w+)`", _outside_parentheses(modules)):
            path = ROOT / "areal_fn" / (key if key.endswith("/") else "") / f"{name}.py"
            if (key, name) not in present and path.parent.is_dir() and not path.exists():
                stale.append(f"{key}{name}")
    assert stale == [], f"docs/architecture.md names modules that do not exist: {stale}"
