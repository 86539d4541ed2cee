"""Benchmark: parse 10,000 allocation strings and print the time per string.

The strings are generated deterministically (``random.Random(0)``): one to four
groups of one or two components over every backend, megatron hybrid forms
included, dims in random order with explicit 1s now and then.

    .venv/bin/python bench/bench_allocation.py
"""

import random
import time

from areal_fn.strategy.allocation import Allocation
from areal_fn.strategy.parse import parse_allocation

N_STRINGS = 10_000
_POW2 = (1, 1, 1, 2, 2, 4, 8)


def _dims(rng: random.Random, letters: str) -> dict[str, int]:
    return {letter: rng.choice(_POW2) for letter in letters}


def _spell(rng: random.Random, dims: dict[str, int]) -> str:
    shown = [(k, v) for k, v in dims.items() if v != 1 or k == "d" or rng.random() < 0.2]
    rng.shuffle(shown)
    return "".join(f"{k}{v}" for k, v in shown)


def _component(rng: random.Random, world: int | None, name: str | None) -> tuple[str, int]:
    """One component string and its world size (``world`` when given)."""
    backend = rng.choice(("sglang", "vllm", "fsdp", "megatron", "megatron"))
    letters = {"sglang": "tp", "vllm": "tp", "fsdp": "tc", "megatron": "tpc"}[backend]
    dims = _dims(rng, letters)
    inner = 1
    for v in dims.values():
        inner *= v
    if world is None or world % inner:
        dims = {k: 1 for k in dims}
        inner = 1
        world = world if world is not None else rng.choice(_POW2) * rng.choice(_POW2)
    dims["d"] = world // inner
    head = backend if name is None else f"{backend}[{name}]"
    if backend != "megatron":
        return f"{head}:{_spell(rng, dims)}", world
    stage = dims["d"] * dims["t"] * dims["c"]
    expert = [e for e in (1, 2, 4, 8) if stage % e == 0]
    if rng.random() < 0.3:
        etp = rng.choice(expert)
        ep = rng.choice([e for e in expert if (stage // etp) % e == 0])
        attn = _spell(rng, {k: dims[k] for k in "dptc"})
        ffn = _spell(rng, {"d": stage // (etp * ep), "t": etp, "e": ep})
        return f"{head}:(attn:{attn}|ffn:{ffn})", world
    dims["e"] = rng.choice(expert)
    if dims["p"] > 1:
        dims["v"] = rng.choice((1, 2))
    return f"{head}:{_spell(rng, dims)}", world


def allocation_strings(n: int = N_STRINGS, seed: int = 0) -> list[str]:
    """``n`` valid allocation strings, the same ones for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_groups = rng.randint(1, 4)
        sizes = [rng.choice((1, 1, 2)) for _ in range(n_groups)]
        named = sum(sizes) >= 3 or rng.random() < 0.5
        k = 0
        groups = []
        for size in sizes:
            parts = []
            world = None
            for _ in range(size):
                text, world = _component(rng, world, f"c{i}_{k}" if named else None)
                parts.append(text)
                k += 1
            groups.append("|".join(parts))
        out.append("+".join(groups))
    return out


def bench_parse_allocation(n: int = N_STRINGS, repeats: int = 3) -> float:
    """Best-of-``repeats`` microseconds per ``parse_allocation`` call."""
    strings = allocation_strings(n)
    best = float("inf")
    parsed: list[Allocation] = []
    for _ in range(repeats):
        start = time.perf_counter()
        parsed = [parse_allocation(s) for s in strings]
        best = min(best, time.perf_counter() - start)
    assert len(parsed) == n
    return best / n * 1e6


def bench_model_specs() -> list[tuple[str, float, int, int]]:
    """Build a ModelSpec (and its canonical tensor list) for every file in specs/models."""
    import time
    from pathlib import Path

    from areal_fn.model.spec import model_from_hf_config

    out = []
    for path in sorted((Path(__file__).resolve().parents[1] / "specs" / "models").glob("*.json")):
        start = time.perf_counter()
        spec = model_from_hf_config(path)
        n = len(spec.tensors)
        out.append((path.stem, (time.perf_counter() - start) * 1e3, n, spec.num_params))
    return out


def run() -> None:
    us = bench_parse_allocation()
    print(f"parse_allocation: {N_STRINGS} strings, {us:.1f} us per string (best of 3)")
    print("model_from_hf_config (spec + canonical tensor list):")
    for name, ms, n, params in bench_model_specs():
        print(f"  {name:18s} {ms:8.1f} ms  {n:6d} tensors  {params / 1e9:7.2f}B parameters")


if __name__ == "__main__":
    run()
