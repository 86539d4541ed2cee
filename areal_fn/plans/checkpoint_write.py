"""The old import path of :mod:`areal_fn.plans.checkpoint.write` (same objects)."""

from areal_fn.plans.checkpoint.write import Dedup as Dedup
from areal_fn.plans.checkpoint.write import RankWrites as RankWrites
from areal_fn.plans.checkpoint.write import WritePiece as WritePiece
from areal_fn.plans.checkpoint.write import WritePlan as WritePlan
from areal_fn.plans.checkpoint.write import lift_parts as lift_parts
from areal_fn.plans.checkpoint.write import lifted_for_checkpoint as lifted_for_checkpoint
from areal_fn.plans.checkpoint.write import plan_save as plan_save
from areal_fn.plans.checkpoint.write import unlift_parts as unlift_parts
