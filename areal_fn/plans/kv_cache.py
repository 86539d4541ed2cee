"""The old import path of :mod:`areal_fn.plans.memory.kv_cache` (same objects)."""

from areal_fn.plans.memory.kv_cache import KVCache as KVCache
from areal_fn.plans.memory.kv_cache import kv_cache as kv_cache
