"""Resharding plans, one package: which bytes go from which source rank to which
destination rank, the least any plan must move, and applying a plan to local tensors.

- :mod:`~areal_fn.plans.transfer.plan`: :func:`plan_transfers` (the whole plan),
  :func:`plan_rank_transfers` (one rank's rows), :func:`bucket`.
- :mod:`~areal_fn.plans.transfer.records`: :class:`Transfer`, one row of a plan.
- :mod:`~areal_fn.plans.transfer.classes`: planning by geometry class.
- :mod:`~areal_fn.plans.transfer.bound`: :func:`transfer_lower_bound`, from the two
  layouts alone.
- :mod:`~areal_fn.plans.transfer.apply`: :func:`apply_transfers`, :func:`pack_boxes`,
  :func:`unpack_boxes` (torch tensors in memory; no ranks, no files).

This module is the package's face: the names above import from it, as they imported
from the flat modules it replaces (``plans.transfer``, ``plans.transfer_apply``, ...,
which still import).
"""

from areal_fn.plans.transfer.apply import apply_transfers as apply_transfers
from areal_fn.plans.transfer.apply import copy_box as copy_box
from areal_fn.plans.transfer.apply import pack_boxes as pack_boxes
from areal_fn.plans.transfer.apply import unpack_boxes as unpack_boxes
from areal_fn.plans.transfer.apply import with_views as with_views
from areal_fn.plans.transfer.bound import required_bytes as required_bytes
from areal_fn.plans.transfer.bound import transfer_lower_bound as transfer_lower_bound
from areal_fn.plans.transfer.bound import union_numel as union_numel
from areal_fn.plans.transfer.plan import Bucket as Bucket
from areal_fn.plans.transfer.plan import BucketPlan as BucketPlan
from areal_fn.plans.transfer.plan import TransferPlan as TransferPlan
from areal_fn.plans.transfer.plan import bucket as bucket
from areal_fn.plans.transfer.plan import grid_step as grid_step
from areal_fn.plans.transfer.plan import lifted_pair as lifted_pair
from areal_fn.plans.transfer.plan import plan_rank_transfers as plan_rank_transfers
from areal_fn.plans.transfer.plan import plan_transfers as plan_transfers
from areal_fn.plans.transfer.records import Transfer as Transfer
from areal_fn.plans.transfer.records import check_ranks as check_ranks
from areal_fn.plans.transfer.records import trusted_transfer as trusted_transfer
