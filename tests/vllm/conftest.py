"""What the vLLM tests share: how to run a script in a process of its own, and the env."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the Python with vLLM: $AREAL_FN_VLLM_PYTHON (make sets it), else the repository's
#: .venv-vllm, else this one
VLLM_PYTHON = os.environ.get("AREAL_FN_VLLM_PYTHON") or (
    str(REPO / ".venv-vllm" / "bin" / "python")
    if (REPO / ".venv-vllm" / "bin" / "python").exists()
    else sys.executable
)


def vllm_env(**extra: str) -> dict[str, str]:
    """This process's environment for a vLLM process: small KV cache, one thread list
    per TP rank on this 2-core machine, the repository importable (worker extensions)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["AREAL_FN_VLLM_PYTHON"] = VLLM_PYTHON
    env.update(extra)
    return env


def run_module(module: str, args: list[str], *, timeout_s: float, log: Path) -> int:
    """``python -m module args`` from the repository root; output into ``log``."""
    with log.open("w") as f:
        proc = subprocess.run(
            [VLLM_PYTHON, "-m", module, *args],
            cwd=REPO,
            env=vllm_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    return proc.returncode
