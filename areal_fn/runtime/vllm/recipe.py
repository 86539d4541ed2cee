"""What both ends of a vLLM weight update compute alike: layouts from plain data.

The trainer tells the vLLM workers its layout as a *recipe* (JSON data: the backend,
the parallel degrees and the options that change the layout), never as code; each
worker rebuilds the layout with the same pure functions and checks the digest the
trainer sent, so both ends plan the same transfers or the update is refused before
any byte moves.
"""

import hashlib
import json
from typing import Any

import attrs

from areal_fn.errors import PlanError
from areal_fn.layouts.fsdp2 import Fsdp2Options, fsdp2_layout
from areal_fn.layouts.layout import Layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.spec import ModelSpec
from areal_fn.pipeline.partition import StagePlan
from areal_fn.strategy.allocation import ParallelDims

__all__ = ["layout_digest", "layout_from_recipe", "model_digest", "trainer_recipe"]


def trainer_recipe(engine: Any) -> dict[str, Any]:
    """The recipe of a training engine's layout (an ``Fsdp2Engine`` or ``MegatronEngine``)."""
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine
    from areal_fn.runtime.engines.megatron import MegatronEngine

    dims = attrs.asdict(engine.dims)
    if isinstance(engine, Fsdp2Engine):
        return {"backend": "fsdp", "dims": dims, "options": attrs.asdict(engine.options)}
    if isinstance(engine, MegatronEngine):
        stages = engine.layout.stages
        assert stages is not None  # a Megatron layout carries its stage plan
        return {
            "backend": "megatron",
            "dims": dims,
            "stage_lengths": list(stages.stage_lengths),
            "vocab_divisible_by": engine.vocab_divisible_by,
        }
    raise PlanError(
        f"a vLLM weight update takes an Fsdp2Engine or a MegatronEngine, not "
        f"{type(engine).__name__}"
    )


def layout_from_recipe(model: ModelSpec, recipe: dict[str, Any]) -> Layout:
    """The layout a recipe describes (raises :class:`PlanError` on a malformed recipe)."""
    try:
        dims = ParallelDims(**recipe["dims"])
        backend = recipe["backend"]
        if backend == "fsdp":
            return fsdp2_layout(model, dims, options=Fsdp2Options(**recipe["options"]))
        if backend == "megatron":
            lengths = tuple(int(n) for n in recipe["stage_lengths"])
            plan = StagePlan(
                costs=(1.0,) * sum(lengths),
                num_stages=dims.pp,
                vpp=dims.vpp,
                stage_lengths=lengths,
                allow_empty_ends=True,
            )
            return megatron_layout(
                model, dims, stages=plan, vocab_divisible_by=int(recipe["vocab_divisible_by"])
            )
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"malformed trainer layout recipe {recipe!r}: {e}") from e
    raise PlanError(
        f"trainer layout recipe backend={recipe.get('backend')!r} is not 'fsdp' or 'megatron'"
    )


def layout_digest(layout: Layout) -> str:
    """A digest of every rank's tensors of ``layout`` (equal layouts, equal digests)."""
    text = repr((layout.kind, layout.world_size, layout.canonical, layout.tensors))
    return hashlib.sha256(text.encode()).hexdigest()


def model_digest(model: ModelSpec) -> str:
    """A digest of the canonical tensors (names, shapes) of ``model``."""
    text = json.dumps([[t.name, list(t.shape)] for t in model.tensors])
    return hashlib.sha256(text.encode()).hexdigest()
