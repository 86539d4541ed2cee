"""The old import path of :mod:`areal_fn.plans.checkpoint.keyed` (same objects)."""

from areal_fn.plans.checkpoint.keyed import KEY_ENV as KEY_ENV
from areal_fn.plans.checkpoint.keyed import MIN_KEY_BYTES as MIN_KEY_BYTES
from areal_fn.plans.checkpoint.keyed import check_key as check_key
from areal_fn.plans.checkpoint.keyed import check_keyed_digest as check_keyed_digest
from areal_fn.plans.checkpoint.keyed import is_keyed_by as is_keyed_by
from areal_fn.plans.checkpoint.keyed import keyed_digest as keyed_digest
from areal_fn.plans.checkpoint.keyed import with_keyed_digest as with_keyed_digest
