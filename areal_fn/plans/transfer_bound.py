"""The old import path of :mod:`areal_fn.plans.transfer.bound` (same objects)."""

from areal_fn.plans.transfer.bound import required_bytes as required_bytes
from areal_fn.plans.transfer.bound import transfer_lower_bound as transfer_lower_bound
from areal_fn.plans.transfer.bound import union_numel as union_numel
