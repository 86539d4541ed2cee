"""The old import path of :mod:`areal_fn.plans.transfer.classes` (same objects)."""

from areal_fn.plans.transfer.classes import Planner as Planner
from areal_fn.plans.transfer.classes import Ranges as Ranges
from areal_fn.plans.transfer.classes import local_of as local_of
from areal_fn.plans.transfer.classes import no_gc as no_gc
