"""Versions and devices of this machine: torch, CUDA, NCCL, megatron-core, the GPUs."""

import importlib.metadata
import platform

import torch

__all__ = ["cuda_gpus", "no_cuda_message", "versions"]


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cuda_gpus() -> int:
    """CUDA devices torch sees (0 without CUDA, or with a CPU-only torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_cuda_message() -> str:
    """Why no check can run here: what torch says about CUDA, and what to do."""
    why = (
        f"torch {torch.__version__} is built without CUDA"
        if torch.version.cuda is None
        else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    )
    return (
        f"no CUDA device present: {why}. Run this on a machine with an NVIDIA GPU and a "
        "CUDA build of torch, or pass --dry-run to print the plan of checks and budgets"
    )


def versions() -> dict[str, str | int]:
    """What the report records: software versions, GPU count and names."""
    gpus = cuda_gpus()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "n/a"
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": nccl,
        "megatron-core": _dist_version("megatron-core"),
        "transformers": _dist_version("transformers"),
        "beartype": _dist_version("beartype"),
        "gpus": gpus,
        "gpu": ", ".join(names) or "none",
    }
