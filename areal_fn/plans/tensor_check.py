"""One check of the tensors given against the tensors expected: missing, unexpected, mis-shaped.

Every path that compares tensors it was handed with the ones a layout or a model names
goes through :func:`diff_shapes`, so the lists come in one order and are cut the same
way: the first :data:`SHOWN` names, then ``... and N more``.

- :func:`check_local_tensors` (with :func:`local_tensor_problems`, one rank's part) is
  the one owner of "local states vs layout": saving and loading checkpoints
  (``CheckpointError``) and converting local states to HF (``ConversionError``) call it.
  Its message::

      local states do not match the fsdp2 layout: rank 1 misses ['a', 'b']; rank 1 has
      unexpected ['c']; rank 1 mis-shaped ['model.norm.weight (3,) != (32,)']

- canonical checks (:func:`~areal_fn.plans.checkpoint.manifest.check_model`,
  :func:`~areal_fn.plans.convert.check_canonical`) word the same lists their own way.

Pure: it takes shapes, not tensors (callers pass ``{name: tuple(t.shape)}``).
"""

from collections.abc import Mapping, Sequence

import attrs

from areal_fn.errors import SpecError
from areal_fn.layouts.layout import Layout
from areal_fn.typecheck import beartype

Shape = tuple[int, ...]

#: How many entries a list shows before ``... and N more``.
SHOWN = 5


@attrs.frozen(kw_only=True)
class ShapeDiff:
    """What differs between the tensors given and those expected.

    ``missing`` and ``misshaped`` follow the expected order, ``unexpected`` is sorted;
    a ``misshaped`` entry is ``(name, given shape, expected shape)``.
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    misshaped: tuple[tuple[str, Shape, Shape], ...]

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.misshaped)


@beartype
def diff_shapes(expected: Mapping[str, Shape], given: Mapping[str, Shape]) -> ShapeDiff:
    """The names ``given`` lacks, the ones it has beyond ``expected``, and the mis-shaped ones."""
    return ShapeDiff(
        missing=tuple(n for n in expected if n not in given),
        unexpected=tuple(sorted(n for n in given if n not in expected)),
        misshaped=tuple(
            (n, tuple(given[n]), tuple(s))
            for n, s in expected.items()
            if n in given and tuple(given[n]) != tuple(s)
        ),
    )


def _rest(items: Sequence[str]) -> str:
    return f"... and {len(items) - SHOWN} more" if len(items) > SHOWN else ""


def listing(items: Sequence[str]) -> str:
    """``['a', 'b']``; beyond :data:`SHOWN` entries ``['a', ..., 'e'] ... and 3 more``."""
    rest = _rest(items)
    return repr(list(items[:SHOWN])) + (f" {rest}" if rest else "")


def joined(items: Sequence[str], sep: str = ", ") -> str:
    """``a, b``; beyond :data:`SHOWN` entries ``a, ..., e, ... and 3 more``."""
    rest = _rest(items)
    return sep.join([*items[:SHOWN], *([rest] if rest else [])])


@beartype
def local_tensor_problems(layout: Layout, rank: int, given: Mapping[str, Shape]) -> tuple[str, ...]:
    """What differs between the local tensors ``rank`` holds (name -> shape) and ``layout``'s.

    ``rank 1 misses [...]``, ``rank 1 has unexpected [...]``, ``rank 1 mis-shaped
    ['name (3,) != (32,)']`` (given, then expected shape); a rank outside the layout is
    one problem. Empty: they match.
    """
    if not 0 <= rank < layout.world_size:
        return (f"rank {rank} is outside the {layout.kind} layout's {layout.world_size} ranks",)
    d = diff_shapes({lt.name: lt.shape for lt in layout.local_tensors(rank)}, given)
    out = []
    if d.missing:
        out.append(f"rank {rank} misses {listing(d.missing)}")
    if d.unexpected:
        out.append(f"rank {rank} has unexpected {listing(d.unexpected)}")
    if d.misshaped:
        shapes = [f"{n} {g} != {w}" for n, g, w in d.misshaped]
        out.append(f"rank {rank} mis-shaped {listing(shapes)}")
    return tuple(out)


@beartype
def check_local_tensors(
    layout: Layout,
    given: Mapping[int, Mapping[str, Shape]],
    *,
    error: type[SpecError],
    every_rank: bool = False,
    also: Mapping[int, Sequence[str]] | None = None,
) -> None:
    """``error`` unless each rank of ``given`` holds exactly its local tensors of ``layout``.

    ``given[rank]`` maps local tensor names to shapes. ``every_rank``: each rank of the
    layout must be given (``no state for ranks [...]``). ``also[rank]``: the caller's own
    problems of that rank (e.g. optimizer state), listed after the rank's tensors. One
    message lists every problem, rank by rank, cut like every list (:func:`joined`).
    """
    problems: list[str] = []
    if every_rank:
        absent = [r for r in range(layout.world_size) if r not in given]
        if absent:
            problems.append(f"no state for ranks {absent}")
    for r in sorted(given):
        problems += local_tensor_problems(layout, r, given[r])
        problems += (also or {}).get(r, ())
    if problems:
        raise error(
            f"local states do not match the {layout.kind} layout: " + joined(problems, sep="; ")
        )
