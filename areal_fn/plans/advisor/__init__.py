"""Strategy advice, one package: the search and what it counts.

- :mod:`~areal_fn.plans.advisor.search`: :func:`suggest_strategy` (the search over
  allocations), :class:`Hardware`, :class:`Suggestion`;
- :mod:`~areal_fn.plans.advisor.score`: the step-time score the search ranks by;
- :mod:`~areal_fn.plans.advisor.census` and :mod:`~areal_fn.plans.advisor.census_groups`:
  a layout's tensors counted by group, without building the layout.

This module is the package's face: the names above import from it, as they imported
from the flat modules it replaces (``plans.advisor``, ``plans.advisor_score``,
``plans.census``, ``plans.census_groups``, which still import).
"""

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
from areal_fn.plans.advisor.score import EP_DISPATCHES as EP_DISPATCHES
from areal_fn.plans.advisor.score import EpSplit as EpSplit
from areal_fn.plans.advisor.score import ep_token_copies as ep_token_copies
from areal_fn.plans.advisor.search import MAX_CP as MAX_CP
from areal_fn.plans.advisor.search import MAX_PP as MAX_PP
from areal_fn.plans.advisor.search import MIN_TOKENS_PER_CP_RANK as MIN_TOKENS_PER_CP_RANK
from areal_fn.plans.advisor.search import VPP_CHOICES as VPP_CHOICES
from areal_fn.plans.advisor.search import CommEstimate as CommEstimate
from areal_fn.plans.advisor.search import CommTerm as CommTerm
from areal_fn.plans.advisor.search import Hardware as Hardware
from areal_fn.plans.advisor.search import Suggestion as Suggestion
from areal_fn.plans.advisor.search import suggest_strategy as suggest_strategy
