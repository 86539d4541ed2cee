"""Run benchmarks: ``python -m bench`` (all) or ``python -m bench shard ...`` (some).

Every module ``bench/bench_<name>.py`` exposes ``run() -> None``, which prints its own
figures; this runner prints a header per benchmark and its wall time.
"""

import importlib
import pkgutil
import sys
import time
from pathlib import Path

PREFIX = "bench_"


def available() -> list[str]:
    """Benchmark names found in this folder, sorted."""
    folder = str(Path(__file__).resolve().parent)
    return sorted(
        m.name[len(PREFIX) :] for m in pkgutil.iter_modules([folder]) if m.name.startswith(PREFIX)
    )


def main(argv: list[str]) -> int:
    names = argv or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(
            f"unknown benchmark(s) {unknown}; available: {available()} "
            f"(each is a module bench/{PREFIX}<name>.py with a run() function)",
            file=sys.stderr,
        )
        return 2
    for name in names:
        module = importlib.import_module(f"bench.{PREFIX}{name}")
        print(f"== {name} " + "=" * max(0, 70 - len(name)), flush=True)
        start = time.perf_counter()
        module.run()
        print(f"-- {name}: {time.perf_counter() - start:.1f} s\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
