"""The pure core imports no torch.distributed, reads no environment, touches no files.

Everything outside ``areal_fn/runtime/`` and ``areal_fn/cli.py`` is checked, by its
source (imports and calls) and by importing it in a fresh interpreter.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "areal_fn"
#: modules allowed effects (paths relative to areal_fn/): the CLI, the impure shell (runtime/).
IMPURE = {"cli.py", "__main__.py"}
#: (module, function) pairs allowed to read a file: foreign inputs enter through these.
FILE_READERS = {("model/spec.py", "load_hf_config")}
#: modules that host such a reader may import what it needs (paths; no environment).
READER_IMPORTS = {
    "model/spec.py": {"os", "pathlib", "json"},
    # the embedded configs (specs/models/*.json) that load_hf_config resolves names to
    "model/embedded.py": {"pathlib"},
    "typecheck.py": {"random"},
}

FORBIDDEN_IMPORTS = (
    "torch.distributed",
    "os",
    "pathlib",
    "subprocess",
    "socket",
    "tempfile",
    "shutil",
    "random",
    "time",
    "datetime",
)
FORBIDDEN_CALLS = {"open", "getenv", "environ", "input", "exec", "eval"}


def core_files() -> list[pathlib.Path]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in ("runtime", "testing") or rel.as_posix() in IMPURE:
            continue
        out.append(p)
    return out


def _enclosing_functions(tree: ast.AST) -> dict[ast.AST, str]:
    owner: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                owner.setdefault(node, fn.name)
    return owner


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_source_is_pure(path):
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT).as_posix()
    owner = _enclosing_functions(tree)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        for n in names:
            allowed_reader = (
                rel,
                owner.get(node),
            ) in FILE_READERS or n in READER_IMPORTS.get(rel, ())
            if (
                any(n == f or n.startswith(f + ".") for f in FORBIDDEN_IMPORTS)
                and not allowed_reader
            ):
                problems.append(f"line {node.lineno}: imports {n}")
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in FORBIDDEN_CALLS and (rel, owner.get(node)) not in FILE_READERS:
                problems.append(f"line {node.lineno}: uses {name}")
    assert not problems, f"{path.relative_to(ROOT)} is part of the pure core but " + "; ".join(
        problems
    )


def test_importing_the_core_starts_nothing_and_reads_no_environment():
    mods = [
        "areal_fn." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in core_files()
    ]
    mods = [m.removesuffix(".__init__") for m in mods]
    code = f"""
import os, sys, torch
CORE = {str(ROOT)!r}
def _check(k):
    f = sys._getframe(2).f_code.co_filename
    if f.startswith(CORE) and '/runtime/' not in f:
        raise SystemExit('core module ' + f + ' read os.environ[' + repr(k) + ']')
class Env(dict):
    def __getitem__(self, k):
        _check(k)
        return super().__getitem__(k)
    def get(self, k, d=None):
        _check(k)
        return super().get(k, d)
before = set(sys.modules)
real = os.environ
os.environ = Env(real)
import importlib
for m in {mods!r}:
    importlib.import_module(m)
os.environ = real
import torch.distributed as dist
assert not dist.is_initialized(), 'core initialised a process group'
new = sorted(m for m in set(sys.modules) - before if m.startswith(('torch.distributed', 'megatron', 'transformers')))
assert not new, f'core imported {{new}}'
print('ok', len({mods!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


def test_calling_the_core_leaves_pythons_random_stream_alone():
    """Type checks draw from ``random``; areal_fn restores it, so seeded data orders hold."""
    import random

    from areal_fn import (
        ParallelDims,
        fsdp2_layout,
        megatron_layout,
        model_from_hf_config,
        parse_allocation,
        plan_transfers,
    )
    from areal_fn.model.demo import DEMO_CONFIG

    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    got = [random.random()]
    model = model_from_hf_config(DEMO_CONFIG)
    a = fsdp2_layout(model, ParallelDims(dp=2, tp=2))
    b = megatron_layout(model, parse_allocation("megatron:t2p2").training.dims)
    a.local_tensors(1)
    got.append(random.random())
    plan_transfers(a, b)
    got.append(random.random())
    assert got == expected
