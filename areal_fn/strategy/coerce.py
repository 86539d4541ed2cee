"""What the layout functions, ``check_strategy`` and ``estimate_memory`` accept as a strategy.

They take :class:`~areal_fn.strategy.allocation.ParallelDims`, and also what a user
holds at hand: an allocation string (``"fsdp:d4t2"``), a parsed
:class:`~areal_fn.strategy.allocation.Allocation` or one of its
:class:`~areal_fn.strategy.allocation.Component` s. :func:`as_dims` turns such a value
into the degrees of its one component; where that is ambiguous (several components, a
component of another backend) it raises a one-line :class:`~areal_fn.errors.LayoutError`
that says what to pass instead.
"""

from areal_fn.errors import LayoutError
from areal_fn.strategy.allocation import Allocation, Backend, Component, ParallelDims
from areal_fn.strategy.parse import parse_allocation
from areal_fn.typecheck import beartype

__all__ = ["Strategy", "as_allocation", "as_component", "as_dims"]

#: A strategy as the entry points accept it.
Strategy = ParallelDims | Component | Allocation | str


def _shown(value: Component | Allocation | str) -> str:
    return repr(value) if isinstance(value, str) else repr(str(value))


@beartype
def as_component(value: Component | Allocation | str, *, caller: str) -> Component:
    """The one component of ``value``; ``LayoutError`` naming the components when there
    are several (``caller`` is the function named in the message)."""
    if isinstance(value, Component):
        return value
    allocation = parse_allocation(value) if isinstance(value, str) else value
    comps = allocation.components
    if len(comps) == 1:
        return comps[0]
    listed = ", ".join(repr(str(c)) for c in comps)
    raise LayoutError(
        f"{caller}: {_shown(value)} has {len(comps)} components ({listed}) and {caller} lays "
        f"out one; pass one of them, e.g. {caller}(model, {str(comps[-1])!r}), or "
        f"parse_allocation(...).component(name)"
    )


@beartype
def as_dims(value: Strategy, *, caller: str, backends: tuple[Backend, ...] = ()) -> ParallelDims:
    """The degrees of ``value``: itself if a ``ParallelDims``, else those of its one
    component, which must run on one of ``backends`` (any backend when empty)."""
    if isinstance(value, ParallelDims):
        return value
    comp = as_component(value, caller=caller)
    if backends and comp.backend not in backends:
        wanted = " or ".join(b.value for b in backends)
        raise LayoutError(
            f"{caller}: {_shown(value)} is a {comp.backend.value} component but {caller} lays "
            f"out {wanted}; pass a {wanted} component, or use layout_for(model, component), "
            f"which picks the layout of its backend"
        )
    return comp.dims


@beartype
def as_allocation(value: Strategy, *, caller: str) -> Allocation:
    """``value`` as an allocation; a bare ``ParallelDims`` names no backend and is refused."""
    if isinstance(value, Allocation):
        return value
    if isinstance(value, str):
        return parse_allocation(value)
    if isinstance(value, Component):
        return Allocation(groups=((value,),))
    raise LayoutError(
        f"{caller}: {value!r} names no backend, so which rules apply is not known; pass an "
        f"allocation string such as 'fsdp:{value}', or Component(backend=..., dims=...)"
    )
