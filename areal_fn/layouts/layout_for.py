"""The layout of one allocation component, with each backend's default options."""

from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.strategy.allocation import Allocation, Backend, Component
from areal_fn.strategy.coerce import as_component
from areal_fn.typecheck import beartype


@beartype
def layout_for(model: ModelSpec, component: Component | Allocation | str) -> Layout:
    """The layout of one allocation component (default options; Megatron's default
    stage split, or the even split when the layers do not divide); an allocation or
    allocation string of one component is that component."""
    from areal_fn.layouts.fsdp2 import fsdp2_layout
    from areal_fn.layouts.inference import inference_layout
    from areal_fn.layouts.megatron import megatron_layout, stages_for

    component = as_component(component, caller="layout_for")
    if component.backend is Backend.MEGATRON:
        return megatron_layout(model, component.dims, stages=stages_for(model, component.dims))
    if component.backend is Backend.FSDP:
        return fsdp2_layout(model, component.dims)
    return inference_layout(model, component.dims)
