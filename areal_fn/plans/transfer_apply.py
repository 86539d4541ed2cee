"""The old import path of :mod:`areal_fn.plans.transfer.apply` (same objects)."""

from areal_fn.plans.transfer.apply import Bytes as Bytes
from areal_fn.plans.transfer.apply import apply_transfers as apply_transfers
from areal_fn.plans.transfer.apply import copy_box as copy_box
from areal_fn.plans.transfer.apply import pack_boxes as pack_boxes
from areal_fn.plans.transfer.apply import unpack_boxes as unpack_boxes
from areal_fn.plans.transfer.apply import with_views as with_views
