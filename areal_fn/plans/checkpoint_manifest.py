"""The old import path of :mod:`areal_fn.plans.checkpoint.manifest` (same objects)."""

from areal_fn.plans.checkpoint.manifest import FORMAT as FORMAT
from areal_fn.plans.checkpoint.manifest import FORMAT_VERSION as FORMAT_VERSION
from areal_fn.plans.checkpoint.manifest import OPTIM_PREFIX as OPTIM_PREFIX
from areal_fn.plans.checkpoint.manifest import OPTIMIZERS as OPTIMIZERS
from areal_fn.plans.checkpoint.manifest import CheckpointManifest as CheckpointManifest
from areal_fn.plans.checkpoint.manifest import Chunk as Chunk
from areal_fn.plans.checkpoint.manifest import FileDigest as FileDigest
from areal_fn.plans.checkpoint.manifest import OptimizerSpec as OptimizerSpec
from areal_fn.plans.checkpoint.manifest import OptimizerState as OptimizerState
from areal_fn.plans.checkpoint.manifest import SavedTensor as SavedTensor
from areal_fn.plans.checkpoint.manifest import StateKind as StateKind
from areal_fn.plans.checkpoint.manifest import check_model as check_model
from areal_fn.plans.checkpoint.manifest import check_optimizer as check_optimizer
from areal_fn.plans.checkpoint.manifest import make_manifest as make_manifest
from areal_fn.plans.checkpoint.manifest import optim_key as optim_key
from areal_fn.plans.checkpoint.manifest import optimizer_spec as optimizer_spec
