"""The old import path of :mod:`areal_fn.plans.checkpoint.read` (same objects)."""

from areal_fn.plans.checkpoint.read import LoadPlan as LoadPlan
from areal_fn.plans.checkpoint.read import PadPiece as PadPiece
from areal_fn.plans.checkpoint.read import ReadPiece as ReadPiece
from areal_fn.plans.checkpoint.read import plan_load as plan_load
