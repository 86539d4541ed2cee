"""The layout of one allocation component, with each backend's default options."""

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.strategy.allocation import Backend, Component
from areal_fn.typecheck import beartype


@beartype
def layout_for(model: ModelSpec, component: Component) -> Layout:
    """The layout of one allocation component (default options; Megatron's default
    stage split, or the even split when the layers do not divide)."""
    from areal_fn.layouts.fsdp2 import fsdp2_layout
    from areal_fn.layouts.inference import inference_layout
    from areal_fn.layouts.megatron import default_stages, megatron_layout
    from areal_fn.pipeline.partition import split_evenly

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
