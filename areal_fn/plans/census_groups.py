"""The old import path of :mod:`areal_fn.plans.advisor.census_groups` (same objects)."""

from areal_fn.plans.advisor.census_groups import LayerGroup as LayerGroup
from areal_fn.plans.advisor.census_groups import Presence as Presence
from areal_fn.plans.advisor.census_groups import TensorGroup as TensorGroup
