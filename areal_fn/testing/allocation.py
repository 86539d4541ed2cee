"""Hypothesis strategies for allocation records (valid by construction).

Degrees are drawn as divisors of what is left of a drawn world size, never
filtered; every draw shrinks towards world size 1, degree 1, no names and a
single component.
"""

import string

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from areal_fn.strategy.allocation import Allocation, Backend, Component, ParallelDims, divisors

__all__ = ["allocations", "component_names", "components", "parallel_dims"]

_NAME_START = string.ascii_letters + "_"
_NAME_REST = string.ascii_letters + string.digits + "_"


@st.composite
def component_names(draw: st.DrawFn, *, max_size: int = 12) -> str:
    """ASCII identifiers usable as component names (``actor``, ``_r2``)."""
    first = draw(st.sampled_from(_NAME_START))
    return first + draw(st.text(alphabet=_NAME_REST, max_size=max_size - 1))


def _divisor(draw: st.DrawFn, n: int) -> int:
    # Divisors ascend, so this shrinks towards 1.
    return draw(st.sampled_from(divisors(n)))


@st.composite
def parallel_dims(
    draw: st.DrawFn,
    *,
    backend: Backend | None = None,
    world: int | None = None,
    max_world: int = 64,
    max_vpp: int = 4,
) -> ParallelDims:
    """Degrees valid for ``backend`` (any backend's rules when None).

    The world size is ``world`` when given, else drawn in ``[1, max_world]``; it is
    then factored into tp, pp, cp (the dims the backend takes) and dp; megatron (or
    None) also draws etp and ep from the divisors of ``dp*tp*cp`` and vpp when pp > 1;
    fsdp draws the HSDP replicas ``dp_replicate`` from the divisors of dp.
    """
    if world is None:
        world = draw(st.integers(1, max_world))
    takes = {
        Backend.SGLANG: "tp",
        Backend.VLLM: "tp",
        Backend.FSDP: "tc",
        Backend.MEGATRON: "tpcev",
        None: "tpcev",
    }[backend]
    rest = world
    degrees = {}
    for letter in "tpc":
        degrees[letter] = _divisor(draw, rest) if letter in takes else 1
        rest //= degrees[letter]
    tp, pp, cp, dp = degrees["t"], degrees["p"], degrees["c"], rest
    etp = ep = vpp = 1
    if "e" in takes:
        stage = dp * tp * cp
        etp = _divisor(draw, stage)
        ep = _divisor(draw, stage // etp)
    if "v" in takes and pp > 1:
        vpp = draw(st.integers(1, max_vpp))
    replicas = _divisor(draw, dp) if backend is Backend.FSDP else 1  # HSDP: fsdp only
    return ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, dp_replicate=replicas)


_MAYBE_NAME: SearchStrategy[str | None] = st.none() | component_names()


@st.composite
def components(
    draw: st.DrawFn,
    *,
    backend: Backend | None = None,
    name: "str | SearchStrategy[str | None] | None" = _MAYBE_NAME,
    world: int | None = None,
    max_world: int = 64,
) -> Component:
    """A component of ``backend`` (drawn when None) with degrees valid for it.

    ``name`` is a fixed name, None for no name, or a strategy (default: no name or
    a drawn identifier). ``world``/``max_world`` as in :func:`parallel_dims`.
    """
    if backend is None:
        backend = draw(st.sampled_from(list(Backend)))
    if isinstance(name, SearchStrategy):
        name = draw(name)
    dims = draw(parallel_dims(backend=backend, world=world, max_world=max_world))
    return Component(name=name, backend=backend, dims=dims)


@st.composite
def allocations(
    draw: st.DrawFn,
    *,
    max_world: int = 64,
    max_groups: int = 4,
    max_components: int = 5,
) -> Allocation:
    """Valid allocations of at most ``max_components`` components in at most
    ``max_groups`` groups, using at most ``max_world`` ranks in all.

    Colocated components are drawn with the group's world size; with three or more
    components every component gets a unique name, otherwise names are optional.
    """
    n_groups = draw(st.integers(1, max(1, min(max_groups, max_components, max_world))))
    spare_components = max_components - n_groups
    spare_ranks = max_world - n_groups
    sizes: list[int] = []
    worlds: list[int] = []
    for _ in range(n_groups):
        extra = draw(st.integers(0, max(0, spare_components)))
        spare_components -= extra
        sizes.append(1 + extra)
        world = 1 + draw(st.integers(0, max(0, spare_ranks)))
        spare_ranks -= world - 1
        worlds.append(world)
    total = sum(sizes)
    pool = draw(st.lists(component_names(), min_size=total, max_size=total, unique=True))
    if total >= 3:
        names: list[str | None] = list(pool)
    else:
        names = [n if draw(st.booleans()) else None for n in pool]
    groups = []
    k = 0
    for size, world in zip(sizes, worlds, strict=True):
        group = []
        for _ in range(size):
            group.append(draw(components(name=names[k], world=world)))
            k += 1
        groups.append(tuple(group))
    return Allocation(groups=tuple(groups))
