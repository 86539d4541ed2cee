"""A weights-only checkpoint manifest of a save plan, for the save/load plan laws."""

from areal_fn.model.spec import ModelSpec
from areal_fn.plans.checkpoint import WritePlan
from areal_fn.plans.checkpoint.manifest import CheckpointManifest, make_manifest, optimizer_spec


def weights_manifest(
    plan: WritePlan, model: ModelSpec, *, allocation: str = "synthetic"
) -> CheckpointManifest:
    """The manifest of ``plan`` (``plan_save``'s) for ``model``: step 1, no optimizer
    state, the canonical dtypes."""
    return make_manifest(
        plan,
        allocation=allocation,
        model_config=model.hf_config(),
        step=1,
        optimizer=optimizer_spec("none"),
        dtypes={t.name: t.dtype for t in model.tensors},
        library_version="0.1.0",
    )
