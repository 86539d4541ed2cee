"""The old import path of :mod:`areal_fn.plans.advisor.score` (same objects)."""

from areal_fn.plans.advisor.score import EP_DISPATCHES as EP_DISPATCHES
from areal_fn.plans.advisor.score import CommEstimate as CommEstimate
from areal_fn.plans.advisor.score import CommTerm as CommTerm
from areal_fn.plans.advisor.score import EpSplit as EpSplit
from areal_fn.plans.advisor.score import Hardware as Hardware
from areal_fn.plans.advisor.score import ep_token_copies as ep_token_copies
