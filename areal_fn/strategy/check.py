"""`check_strategy`: refuse, before any process starts, what cannot run."""

from areal_fn.errors import LayoutError
from areal_fn.model.spec import ModelSpec
from areal_fn.strategy.allocation import Backend, Component
from areal_fn.strategy.coerce import Strategy, as_allocation
from areal_fn.strategy.rows import check_rows
from areal_fn.strategy.rules import Kind, check_dims
from areal_fn.typecheck import beartype

#: The rules each backend's components follow (an engine's: the inference layout's plus
#: what its own model code cannot hold).
KIND: dict[Backend, Kind] = {
    Backend.FSDP: "fsdp2",
    Backend.MEGATRON: "megatron",
    Backend.SGLANG: "sglang",
    Backend.VLLM: "vllm",
}


def check_component(model: ModelSpec, component: Component) -> None:
    """Raise ``LayoutError`` if ``component`` cannot hold ``model``, by the one rule of
    :func:`~areal_fn.strategy.rules.check_dims` that its layout checks too (for an
    inference engine also what its own model code cannot hold)."""
    try:
        check_dims(model, KIND[component.backend], component.dims)
    except LayoutError as e:
        raise LayoutError(
            f"{component.label} ({component}) cannot hold this {model.model_type} model: {e}"
        ) from None


@beartype
def check_strategy(
    model: ModelSpec,
    allocation: Strategy,
    *,
    n_devices: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Raise ``LayoutError`` when ``allocation`` cannot run ``model``.

    Checks every component by the rule its layout uses
    (:func:`~areal_fn.strategy.rules.check_dims`: heads and KV heads against TP, with
    the inference engines' KV-head replication when TP exceeds them; channels and the
    padded vocabulary against TP; fsdp's ``c`` against the heads a TP rank keeps;
    experts against EP; layers against PP x VPP), what the inference engines' own model
    code cannot hold, and, when ``n_devices`` is given, that the allocation's world size
    equals it; when ``seq_len`` is given, that rows of that many tokens split as the
    training engines split them under ``c`` (:func:`check_rows`: ``2 * cp`` chunks for
    Megatron context parallelism, ``cp`` parts for FSDP2's Ulysses). Each degree refusal
    lists the values of the refused degree that pass.
    ``allocation`` may be a string or one component; a bare ``ParallelDims`` (no
    backend) is refused with the spelling to use.
    """
    allocation = as_allocation(allocation, caller="check_strategy")
    if n_devices is not None and allocation.world_size != n_devices:
        raise LayoutError(
            f"allocation {allocation} needs {allocation.world_size} ranks but {n_devices} devices were given; "
            f"change the degrees so their product is {n_devices} or launch {allocation.world_size} processes"
        )
    for component in allocation.components:
        check_component(model, component)
        if seq_len is not None:
            check_rows(component, seq_len)
