"""The old import path of :mod:`areal_fn.plans.memory.lora` (same objects)."""

from areal_fn.plans.memory.lora import estimate_lora_memory as estimate_lora_memory
from areal_fn.plans.memory.lora import lora_adapter_census as lora_adapter_census
from areal_fn.plans.memory.lora import lora_rows as lora_rows
