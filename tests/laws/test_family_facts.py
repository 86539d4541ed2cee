"""A family's facts live in its module: no module outside ``model/families/`` names a
registered ``model_type`` in its code (docstrings may), so adding a family never edits
a rule, a layout or a builder for a ``model_type`` check; nor the full checkpoint name
of a tensor outside the decoder layers (``Family.outer``: embedding, final norm,
output layer).

Exempt, with the reason: ``model/demo.py`` (the main job's own ``config.json``, a
``qwen2`` model by choice) and ``testing/`` (hypothesis strategies that draw each
family's own config keys).
"""

import ast
import pathlib

from areal_fn.model.families import FAMILIES, MODEL_TYPE_ALIASES
from areal_fn.model.families.roles import role_conflicts

ROOT = pathlib.Path(__file__).resolve().parents[2] / "areal_fn"
EXEMPT = ("model/families/", "model/demo.py", "testing/")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _model_type_literals(
    path: pathlib.Path, names: set[str], root: pathlib.Path = ROOT
) -> list[str]:
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    return [
        f"{path.relative_to(root)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and id(node) not in docs and node.value in names
    ]


def test_no_module_outside_the_families_names_a_model_type() -> None:
    names = set(FAMILIES) | {alias for alias, _ in MODEL_TYPE_ALIASES}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(EXEMPT):
            found += _model_type_literals(path, names)
    assert found == [], "model_type literals outside model/families/:\n" + "\n".join(found)


def test_the_check_finds_a_literal(tmp_path: pathlib.Path) -> None:
    """The scan sees a literal in code and skips one in a docstring."""
    src = tmp_path / "m.py"
    src.write_text('"""A llama model."""\n\n\ndef f(m):\n    return m.model_type == "llama"\n')
    assert _model_type_literals(src, set(FAMILIES), tmp_path) == ["m.py:5: 'llama'"]


def test_no_module_outside_the_families_names_an_outer_tensor() -> None:
    names = {
        n
        for f in FAMILIES.values()
        for n in (f.outer.embedding, f.outer.final_norm, f.outer.output)
    }
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(EXEMPT):
            found += _model_type_literals(path, names)
    assert found == [], "outer tensor names outside model/families/:\n" + "\n".join(found)


#: Modules that still name decoder-layer tensors or modules of the tables, each with why
#: (none today; an entry goes once its module no longer names one).
LAYER_NAME_EXEMPT: dict[str, str] = {}


def _layer_names() -> set[str]:
    """Every table record's name relative to its layer, its last two parts and its module."""
    out: set[str] = set()
    for fam in FAMILIES.values():
        for r in fam.canonical:
            parts = r.name.replace("{e}.", "").split(".")
            out |= {r.name, ".".join(parts[-2:])}
            mods = [p for p in parts if p not in ("weight", "bias")]
            out |= {mods[-1]} if mods else set()
    return out - {"weight", "bias", "mlp", "self_attn", "experts", "gate", "norm", "router"}


def _names_in(path: pathlib.Path, names: set[str], root: pathlib.Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    return [
        f"{path.relative_to(root)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and any(node.value == n or node.value.endswith("." + n) for n in names)
    ]


def test_no_module_outside_the_families_names_a_layer_tensor() -> None:
    """The tensor-parallel plans (FSDP2 and inference layouts, the FSDP2 engine's parallel
    styles), the strategy rules and the spec read each tensor's role from its family's
    table (``HfTensor.tp``), never a name."""
    names = _layer_names()
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(EXEMPT) and rel not in LAYER_NAME_EXEMPT:
            found += _names_in(path, names)
    assert found == [], "decoder-layer tensor names outside model/families/:\n" + "\n".join(found)


def test_the_layer_name_check_finds_a_suffix(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('_COL = ("q_proj.weight", "model.layers.0.mlp.down_proj.weight", "x")\n')
    assert _names_in(src, _layer_names(), tmp_path) == [
        "m.py:1: 'q_proj.weight'",
        "m.py:1: 'model.layers.0.mlp.down_proj.weight'",
    ]


def test_every_exempt_module_still_names_one() -> None:
    """An exemption goes once its module no longer names a layer tensor."""
    names = _layer_names()
    stale = [rel for rel in LAYER_NAME_EXEMPT if not _names_in(ROOT / rel, names)]
    assert stale == []


def test_one_name_one_split() -> None:
    """Records sharing a name within a family's table agree on role, expert and stacked."""
    assert {mt: role_conflicts(f) for mt, f in FAMILIES.items() if role_conflicts(f)} == {}
