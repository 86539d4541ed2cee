"""`check_strategy`: refuse, before any process starts, what cannot run."""

from .allocation import Allocation, Backend, Component
from .errors import LayoutError
from .fsdp2_layout import check_fsdp2
from .inference_layout import check_inference
from .megatron_layout import check_megatron
from .model import ModelSpec
from .typecheck import beartype


def check_component(model: ModelSpec, component: Component) -> None:
    """Raise ``LayoutError`` if ``component`` cannot hold ``model``."""
    dims = component.dims
    try:
        if component.backend is Backend.MEGATRON:
            check_megatron(model, dims)
        elif component.backend is Backend.FSDP:
            check_fsdp2(model, dims)
            if model.num_layers < 1:
                raise LayoutError("model has no layers")
        else:
            check_inference(model, dims)
    except LayoutError as e:
        raise LayoutError(
            f"{component.label} ({component}) cannot hold this {model.model_type} model: {e}"
        ) from None


@beartype
def check_strategy(
    model: ModelSpec, allocation: Allocation, *, n_devices: int | None = None
) -> None:
    """Raise ``LayoutError`` when ``allocation`` cannot run ``model``.

    Checks every component (heads and KV heads against TP, with the inference
    engines' KV-head replication when TP exceeds them; experts against EP; layers
    against PP x VPP; channels against TP) and, when ``n_devices`` is given, that
    the allocation's world size equals it.
    """
    if n_devices is not None and allocation.world_size != n_devices:
        raise LayoutError(
            f"allocation {allocation} needs {allocation.world_size} ranks but {n_devices} devices were given; "
            f"change the degrees so their product is {n_devices} or launch {allocation.world_size} processes"
        )
    for component in allocation.components:
        check_component(model, component)
