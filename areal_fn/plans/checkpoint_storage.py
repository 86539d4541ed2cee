"""The old import path of :mod:`areal_fn.plans.checkpoint.storage` (same objects)."""

from areal_fn.plans.checkpoint.storage import CHECKSUMS as CHECKSUMS
from areal_fn.plans.checkpoint.storage import DATA_FILE as DATA_FILE
from areal_fn.plans.checkpoint.storage import Checksum as Checksum
from areal_fn.plans.checkpoint.storage import FileDigest as FileDigest
from areal_fn.plans.checkpoint.storage import StoredItem as StoredItem
from areal_fn.plans.checkpoint.storage import check_inside as check_inside
from areal_fn.plans.checkpoint.storage import check_storage as check_storage
