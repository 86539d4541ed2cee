"""Checkpoint plans: which rank writes which canonical box, and which boxes a rank reads.

A checkpoint stores canonical (HF-named) tensors, each cut into *chunks* (boxes)
that tile it exactly; optimizer moments are stored in the same chunks as their
parameter under ``optim/<canonical>/<state>``. Because storage is canonical, any
layout saves and any other layout loads (FSDP2 <-> Megatron, other world sizes).

- :func:`plan_save` deduplicates replicas: every canonical element is written by
  exactly one rank. ``dedup="balanced"`` (default) gives each element to the replica
  that has written the fewest bytes so far (ties to the lower rank); ``"first"`` to the
  first holder in rank order. The plan is a function of the layout alone, so every
  rank computes the same one (:mod:`~areal_fn.plans.checkpoint.write`).
- :class:`CheckpointManifest` is what a checkpoint says about itself: allocation,
  model config, canonical tensors with their chunks and writers, optimizer, step, data
  position, and a checksum (BLAKE3; SHA-256 in older ones) of every file; its JSON carries its own digest
  (:mod:`~areal_fn.plans.checkpoint.manifest`, with the optimizers and the checks).
- :func:`plan_load` intersects a rank's local pieces with the stored chunks: the reads
  that fill that rank's local tensors (padding is listed apart, to be zeroed)
  (:mod:`~areal_fn.plans.checkpoint.read`).

This module gathers the three under one name. Everything here is pure: no files, no
ranks, no clock.
"""

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
from areal_fn.plans.checkpoint.read import LoadPlan as LoadPlan
from areal_fn.plans.checkpoint.read import PadPiece as PadPiece
from areal_fn.plans.checkpoint.read import ReadPiece as ReadPiece
from areal_fn.plans.checkpoint.read import plan_load as plan_load
from areal_fn.plans.checkpoint.write import Dedup as Dedup
from areal_fn.plans.checkpoint.write import RankWrites as RankWrites
from areal_fn.plans.checkpoint.write import WritePiece as WritePiece
from areal_fn.plans.checkpoint.write import WritePlan as WritePlan
from areal_fn.plans.checkpoint.write import plan_save as plan_save
