"""The old import path of :mod:`areal_fn.plans.memory.activations` (same objects)."""

from areal_fn.plans.memory.activations import ActivationModel as ActivationModel
from areal_fn.plans.memory.activations import in_flight_chunks as in_flight_chunks
from areal_fn.plans.memory.activations import layer_token_bytes as layer_token_bytes
