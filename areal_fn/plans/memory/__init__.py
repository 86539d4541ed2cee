"""Memory plans, one package: what each rank holds while training or serving.

- :mod:`~areal_fn.plans.memory.estimate`: :func:`estimate_memory` (exact model state
  from the layout, the report), :func:`estimate_rows`;
- :mod:`~areal_fn.plans.memory.activations`: :class:`ActivationModel`, estimated
  activations and FSDP2 buffers;
- :mod:`~areal_fn.plans.memory.lora`: :func:`estimate_lora_memory` (a frozen base,
  trained adapters);
- :mod:`~areal_fn.plans.memory.kv_cache`: an inference engine's KV cache per rank;
- :mod:`~areal_fn.plans.memory.float8`: :func:`float8_copies`, the FP8 copies torchao's
  float8 training creates in a step (:func:`with_float8` adds them to a report).

This module is the package's face: the names above import from it, as they imported
from the flat modules it replaces (``plans.memory``, ``plans.activations``,
``plans.kv_cache``, ``plans.lora_memory``, which still import).
"""

from areal_fn.plans.memory.estimate import GIB as GIB
from areal_fn.plans.memory.estimate import STEP_BYTES as STEP_BYTES
from areal_fn.plans.memory.estimate import ActivationModel as ActivationModel
from areal_fn.plans.memory.estimate import MemoryReport as MemoryReport
from areal_fn.plans.memory.estimate import Optimizer as Optimizer
from areal_fn.plans.memory.estimate import PrecisionPolicy as PrecisionPolicy
from areal_fn.plans.memory.estimate import RankMemory as RankMemory
from areal_fn.plans.memory.estimate import data_parallel_numels as data_parallel_numels
from areal_fn.plans.memory.estimate import estimate_memory as estimate_memory
from areal_fn.plans.memory.estimate import estimate_rows as estimate_rows
from areal_fn.plans.memory.estimate import in_flight_chunks as in_flight_chunks
from areal_fn.plans.memory.estimate import layer_token_bytes as layer_token_bytes
from areal_fn.plans.memory.estimate import local_param_bytes as local_param_bytes
from areal_fn.plans.memory.float8 import FLOAT8_RECIPES as FLOAT8_RECIPES
from areal_fn.plans.memory.float8 import Float8Copies as Float8Copies
from areal_fn.plans.memory.float8 import float8_copies as float8_copies
from areal_fn.plans.memory.float8 import float8_linears as float8_linears
from areal_fn.plans.memory.float8 import with_float8 as with_float8
from areal_fn.plans.memory.kv_cache import KVCache as KVCache
from areal_fn.plans.memory.kv_cache import kv_cache as kv_cache
from areal_fn.plans.memory.lora import estimate_lora_memory as estimate_lora_memory
from areal_fn.plans.memory.lora import lora_adapter_census as lora_adapter_census
from areal_fn.plans.memory.lora import lora_rows as lora_rows
