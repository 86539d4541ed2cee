"""The old import path of :mod:`areal_fn.plans.transfer.records` (same objects)."""

from areal_fn.plans.transfer.records import Transfer as Transfer
from areal_fn.plans.transfer.records import check_ranks as check_ranks
from areal_fn.plans.transfer.records import trusted_transfer as trusted_transfer
