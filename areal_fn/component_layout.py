"""The layout of one allocation component, with each backend's default options."""

from .allocation import Backend, Component
from .errors import SpecError
from .layout import Layout
from .model import ModelSpec
from .typecheck import beartype


@beartype
def layout_for(model: ModelSpec, component: Component) -> Layout:
    """The layout of one allocation component (default options; Megatron's default
    stage split, or the even split when the layers do not divide)."""
    from .fsdp2_layout import fsdp2_layout
    from .inference_layout import inference_layout
    from .megatron_layout import default_stages, megatron_layout
    from .pipeline import split_evenly

    if component.backend is Backend.MEGATRON:
        dims = component.dims
        try:
            stages = default_stages(model, dims)
        except SpecError:
            stages = split_evenly([1.0] * model.num_layers, dims.pp, vpp=dims.vpp)
        return megatron_layout(model, dims, stages=stages)
    if component.backend is Backend.FSDP:
        return fsdp2_layout(model, component.dims)
    return inference_layout(model, component.dims)
