"""The old import path of :mod:`areal_fn.plans.advisor.census` (same objects)."""

from areal_fn.plans.advisor.census import DATA_PARALLEL_AXES as DATA_PARALLEL_AXES
from areal_fn.plans.advisor.census import Census as Census
from areal_fn.plans.advisor.census import CensusIndex as CensusIndex
from areal_fn.plans.advisor.census import LayerGroup as LayerGroup
from areal_fn.plans.advisor.census import Presence as Presence
from areal_fn.plans.advisor.census import RankShare as RankShare
from areal_fn.plans.advisor.census import TensorGroup as TensorGroup
from areal_fn.plans.advisor.census import census_of as census_of
from areal_fn.plans.advisor.census import fsdp2_census as fsdp2_census
from areal_fn.plans.advisor.census import megatron_census as megatron_census
from areal_fn.plans.advisor.census import rank_share as rank_share
