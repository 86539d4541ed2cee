"""The groups a :class:`~areal_fn.plans.advisor.census.Census` counts.

A :class:`TensorGroup` is ``count`` logical tensors of one shape, sharding and
presence; a :class:`LayerGroup` the decoder layers whose tensors live on one mesh with
one presence. Presence is a tuple of ``(mesh axis, coordinate)`` pairs: the tensor
exists only on the ranks at those coordinates (a pipeline stage, an expert-parallel
rank). The sort keys put groups in the census's order (mesh axes, mesh sizes,
presence, shape, placements).
"""

from collections.abc import Iterable, Mapping

import attrs

from areal_fn.errors import SpecError
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.sharding import Sharding, check_sharding

__all__ = ["LayerGroup", "Presence", "TensorGroup"]

Presence = tuple[tuple[str, int], ...]


def _presence(value: object) -> Presence:
    if isinstance(value, Mapping):
        value = tuple(value.items())
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise SpecError(f"presence={value!r} must be (axis, coordinate) pairs")
    out = []
    for item in value:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise SpecError(f"presence={value!r} must be (axis, coordinate) pairs")
        out.append((str(item[0]), int(item[1])))
    return tuple(out)


def _shape(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _check_count(_inst: object, attr: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"TensorGroup.{attr.name}={value!r} must be an int >= 1")


def _check_presence(mesh: Mesh, present: Presence, what: str) -> None:
    for axis, c in present:
        if axis not in mesh.names or not 0 <= c < mesh.axis_size(axis):
            raise SpecError(
                f"{what}: presence {axis}={c} does not fit {mesh}; use an axis of the mesh and "
                f"a coordinate inside it"
            )


@attrs.frozen(kw_only=True)
class TensorGroup:
    """``count`` logical tensors of one ``shape``, ``sharding`` and presence."""

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    sharding: Sharding = attrs.field(validator=attrs.validators.instance_of(Sharding))
    present: Presence = attrs.field(default=(), converter=_presence)
    count: int = attrs.field(default=1, validator=_check_count)

    def __attrs_post_init__(self) -> None:
        check_sharding(self.shape, self.sharding)
        _check_presence(self.sharding.mesh, self.present, f"TensorGroup of shape {self.shape}")


def _layers(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(value)))


@attrs.frozen(kw_only=True)
class LayerGroup:
    """Decoder layers whose tensors live on ``mesh`` with presence ``present``."""

    mesh: Mesh = attrs.field(validator=attrs.validators.instance_of(Mesh))
    present: Presence = attrs.field(default=(), converter=_presence)
    layers: tuple[int, ...] = attrs.field(converter=_layers)

    def __attrs_post_init__(self) -> None:
        _check_presence(self.mesh, self.present, "LayerGroup")


def _group_key(g: TensorGroup) -> tuple[object, ...]:
    m = g.sharding.mesh
    return (m.names, m.sizes, g.present, g.shape, repr(g.sharding.placements))


def _layer_key(g: LayerGroup) -> tuple[object, ...]:
    return (g.mesh.names, g.mesh.sizes, g.present)
