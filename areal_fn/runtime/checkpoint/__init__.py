"""Canonical distributed checkpoints: save, load under any strategy, inspect, export, Megatron-Core interop.

``from areal_fn.runtime.checkpoint import save_checkpoint, load_checkpoint`` (the
functions live in :mod:`areal_fn.runtime.checkpoint.api`).
"""

from areal_fn.runtime.checkpoint.api import LATEST as LATEST
from areal_fn.runtime.checkpoint.api import MANIFEST as MANIFEST
from areal_fn.runtime.checkpoint.api import CheckpointReader as CheckpointReader
from areal_fn.runtime.checkpoint.api import HfFiles as HfFiles
from areal_fn.runtime.checkpoint.api import LoadResult as LoadResult
from areal_fn.runtime.checkpoint.api import PendingSave as PendingSave
from areal_fn.runtime.checkpoint.api import RankState as RankState
from areal_fn.runtime.checkpoint.api import capture_rng as capture_rng
from areal_fn.runtime.checkpoint.api import checkpoint_hf_files as checkpoint_hf_files
from areal_fn.runtime.checkpoint.api import cmd_checkpoint_export_hf as cmd_checkpoint_export_hf
from areal_fn.runtime.checkpoint.api import cmd_checkpoint_inspect as cmd_checkpoint_inspect
from areal_fn.runtime.checkpoint.api import export_hf as export_hf
from areal_fn.runtime.checkpoint.api import export_megatron_checkpoint as export_megatron_checkpoint
from areal_fn.runtime.checkpoint.api import import_megatron_checkpoint as import_megatron_checkpoint
from areal_fn.runtime.checkpoint.api import inspect_checkpoint as inspect_checkpoint
from areal_fn.runtime.checkpoint.api import list_checkpoints as list_checkpoints
from areal_fn.runtime.checkpoint.api import load_checkpoint as load_checkpoint
from areal_fn.runtime.checkpoint.api import read_hf_files as read_hf_files
from areal_fn.runtime.checkpoint.api import read_manifest as read_manifest
from areal_fn.runtime.checkpoint.api import resolve_checkpoint as resolve_checkpoint
from areal_fn.runtime.checkpoint.api import restore_rng as restore_rng
from areal_fn.runtime.checkpoint.api import save_checkpoint as save_checkpoint
from areal_fn.runtime.checkpoint.api import verify_checkpoint as verify_checkpoint
