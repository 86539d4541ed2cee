"""Training engines (FSDP2, Megatron-Core), the TP stand-in inference engine, and
applying FSDP2 layouts to modules.

``from areal_fn.runtime.engines import Fsdp2Engine, MegatronEngine, AdamWConfig`` works;
the engines load on first use, so importing this package pulls in neither transformers
nor Megatron-Core.
"""

from typing import Any

from areal_fn.runtime.engines.common import AdamWConfig as AdamWConfig
from areal_fn.runtime.engines.common import LRSchedule as LRSchedule
from areal_fn.runtime.engines.protocol import Engine as Engine


def __getattr__(name: str) -> Any:
    if name == "Fsdp2Engine":
        from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine

        return Fsdp2Engine
    if name == "MegatronEngine":
        from areal_fn.runtime.engines.megatron import MegatronEngine

        return MegatronEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
