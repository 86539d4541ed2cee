"""The package's shape: imports run downward only, and the public face stays the same.

Stages, lowest first (docs/architecture.md): ``errors``/``typecheck``/``version``, then
``sharding``, ``model``, ``strategy``, ``pipeline``, ``layouts``, ``plans``,
``testing``, ``runtime``, ``cli``; the top-level ``__init__`` re-exports the core.
A module may import its own stage and the stages below it, never one above.
"""

import ast
import pathlib

import pytest

import areal_fn

ROOT = pathlib.Path(__file__).resolve().parents[2] / "areal_fn"
ORDER = (
    "base",
    "sharding",
    "model",
    "strategy",
    "pipeline",
    "layouts",
    "plans",
    "testing",
    "runtime",
    "cli",
    "top",
)
BASE = {"errors", "typecheck", "version"}


def stage_of(module: str) -> str:
    """``areal_fn.layouts.fsdp2`` -> ``layouts``; the package itself -> ``top``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    return "base" if parts[1] in BASE else parts[1]


def module_of(path: pathlib.Path) -> str:
    parts = ("areal_fn", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return [(n, m) for n, m in out if m == "areal_fn" or m.startswith("areal_fn.")]


def test_every_module_belongs_to_a_stage() -> None:
    stray = [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if stage_of(module_of(p)) not in ORDER
    ]
    assert stray == [], f"modules outside the stages {ORDER}: {stray}"


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_downward(path: pathlib.Path) -> None:
    mine = ORDER.index(stage_of(module_of(path)))
    up = [
        f"line {n}: {m} ({stage_of(m)})"
        for n, m in imports(path)
        if ORDER.index(stage_of(m)) > mine
    ]
    assert up == [], f"{module_of(path)} ({ORDER[mine]}) imports a stage above it: {up}"


def test_no_module_imports_the_public_face() -> None:
    """Only ``areal_fn/__init__.py`` gathers the API; modules import where things live."""
    bad = [
        f"{module_of(p)} line {n}"
        for p in ROOT.rglob("*.py")
        if p != ROOT / "__init__.py"
        for n, m in imports(p)
        if m == "areal_fn"
    ]
    assert bad == []


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    known = {module_of(p) for p in ROOT.rglob("*.py")}
    for p in ROOT.rglob("*.py"):
        mod = module_of(p)
        for _, m in imports(p):
            # ``from areal_fn.x import y``: y may be a module or a name in x
            graph.setdefault(mod, set()).add(m if m in known else m.rsplit(".", 1)[0])
    # a package's __init__ re-exporting its modules is not a cycle through them
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or node.startswith(nxt + "."):
                continue  # a module importing its own package (__init__ of a parent)
            if seen.get(nxt) == 1:
                raise AssertionError(
                    f"import cycle: {' -> '.join([*stack[stack.index(nxt) :], nxt])}"
                )
            if nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for mod in sorted(graph):
        if mod not in seen:
            visit(mod)


#: The public face: every name ``from areal_fn import *`` gives (additions go here too).
PUBLIC = sorted(
    """
    ActivationModel AdamWConfig Allocation Axis Backend Box Bucket BucketPlan CheckpointError Component
    ConversionError DEMO_CONFIG FusionPiece Fsdp2Options Layout LayoutError LayoutKind LocalTensor
    LogicalTensor MemoryReport Mesh ModelSpec ParallelDims ParseError Partial PartitionSpec
    Piece PlanError PrecisionPolicy Replicate Shard Sharding SpecError StagePlan StridedShard
    Suggestion TensorSpec Transfer TransferPlan UnsupportedConfigError bucket
    canonical_to_hf_state check_sharding check_strategy estimate_memory flop_costs
    canonical_multiplicity from_partition_spec fsdp2_layout hf_memory_view hf_state_to_canonical inference_layout
    iter_to_hf iter_to_megatron load_hf_config local_boxes local_pieces local_shape LRSchedule
    megatron_layout megatron_layout_string memory_costs model_from_hf_config norm_weights padded_vocab_size
    param_costs parse_allocation partition_pipeline plan_transfers rank_grid required_bytes
    shard split_evenly suggest_strategy to_hf to_megatron to_partition_spec
    transfer_lower_bound unshard __version__
    LoraConfig lora_tensors with_lora estimate_lora_memory LossScale Fp8Format plan_fp8_shards
    """.split()
)


def test_the_public_api_is_the_listed_one() -> None:
    names = sorted(n for n in vars(areal_fn) if not n.startswith("_") or n == "__version__")
    names = [n for n in names if not isinstance(getattr(areal_fn, n), type(areal_fn))]
    assert names == PUBLIC


# -- sizes: one concept per module, functions that fit on a screen ------------------------

MAX_FILE_LINES = 520
MAX_FUNCTION_LINES = 80
#: Files or functions allowed over the limits, with the reason.
OVER_LIMIT: dict[str, str] = {}


def _sources() -> list[pathlib.Path]:
    top = ROOT.parent
    return sorted(p for d in ("areal_fn", "bench", "tools") for p in (top / d).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_modules_and_functions_stay_small(path):
    rel = str(path.relative_to(ROOT.parent))
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_FILE_LINES or rel in OVER_LIMIT, (
        f"{rel} has {lines} lines (> {MAX_FILE_LINES}); split it by concept, or list it in "
        "OVER_LIMIT with the reason"
    )
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            key = f"{rel}::{node.name}"
            assert n <= MAX_FUNCTION_LINES or key in OVER_LIMIT, (
                f"{key} has {n} lines (> {MAX_FUNCTION_LINES}, docstring included); break it "
                "into named steps, or list it in OVER_LIMIT with the reason"
            )
