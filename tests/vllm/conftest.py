"""What the vLLM tests share: how to run a script in a process of its own, and the env."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def vllm_env(**extra: str) -> dict[str, str]:
    """This process's environment for a vLLM process: small KV cache, one thread list
    per TP rank on this 2-core machine, the repository importable (worker extensions)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_module(module: str, args: list[str], *, timeout_s: float, log: Path) -> int:
    """``python -m module args`` from the repository root; output into ``log``."""
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=vllm_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    return proc.returncode
