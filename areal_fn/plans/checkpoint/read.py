"""The load plan of a checkpoint: the stored boxes that fill one rank's local tensors.

:func:`plan_load` intersects a rank's local pieces with the stored chunks: the reads
that fill that rank's local tensors (padding is listed apart, to be zeroed). Pure: no
files, no ranks, no clock.
"""

import attrs

from areal_fn.layouts.layout import Layout
from areal_fn.layouts.lift import LocalView
from areal_fn.plans.checkpoint.manifest import CheckpointManifest, check_model
from areal_fn.plans.checkpoint.write import lift_parts, lifted_for_checkpoint, unlift_parts
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype


@attrs.frozen(kw_only=True)
class ReadPiece:
    """Read ``box`` of ``canonical`` (inside stored chunk ``chunk``) into ``tensor[local_box]``."""

    canonical: str
    box: Box
    chunk: Box
    tensor: str
    local_box: Box

    def __str__(self) -> str:
        return f"{self.tensor}{self.local_box} <- {self.canonical}{self.box} (chunk {self.chunk})"


@attrs.frozen(kw_only=True)
class PadPiece:
    """A padding box of a local tensor (no canonical source: zeroed on load)."""

    tensor: str
    local_box: Box


@attrs.frozen(kw_only=True)
class LoadPlan:
    """What one rank reads: every non-padding local element exactly once.

    ``views``: for a layout with strided pieces, the view of each local tensor that the
    reads' and padding's ``local_box`` index (:mod:`areal_fn.layouts.lift`); ``box``
    and ``chunk`` stay plain canonical boxes.
    """

    rank: int
    reads: tuple[ReadPiece, ...]
    padding: tuple[PadPiece, ...]
    views: tuple[tuple[str, LocalView], ...] = ()

    def canonicals(self, tensor: str) -> tuple[str, ...]:
        """Canonical tensors feeding local ``tensor``, in read order, once each."""
        return tuple(dict.fromkeys(r.canonical for r in self.reads if r.tensor == tensor))

    def __str__(self) -> str:
        head = (
            f"LoadPlan rank {self.rank}: {len(self.reads)} reads, {len(self.padding)} padding boxes"
        )
        return "\n".join([head, *(f"  {r}" for r in self.reads)])


@beartype
def plan_load(manifest: CheckpointManifest, layout: Layout, rank: int) -> LoadPlan:
    """The reads that fill ``rank``'s local tensors of ``layout`` from the checkpoint.

    Raises ``CheckpointError`` when the checkpoint holds other canonical tensors than
    the layout's model (missing, extra, mis-shaped). A layout with strided pieces is
    planned in its lifted basis: the reads then index views of its local tensors
    (``LoadPlan.views``); a stored chunk or a strided piece that cuts inside units of
    the steps is read as the plain boxes it is made of (:func:`lift_parts`,
    :func:`unlift_parts`).
    """
    check_model(manifest, layout.canonical)
    lifted = lifted_for_checkpoint(layout)
    steps = dict(lifted.factors)
    chunks: dict[str, list[tuple[Box, Box]]] = {}  # canonical -> (lifted part, chunk)
    for t in manifest.tensors:
        for c in sorted((c.box for c in t.chunks), key=lambda b: b.ranges):
            parts = lift_parts(c, steps[t.name]) if t.name in steps else ((c, c),)
            chunks.setdefault(t.name, []).extend((up, c) for up, _ in parts)
    reads: list[ReadPiece] = []
    padding: list[PadPiece] = []
    for lt in lifted.layout.local_tensors(rank):
        for p in lt.pieces:
            if p.canonical is None or p.canonical_box is None:
                padding.append(PadPiece(tensor=lt.name, local_box=p.local_box))
                continue
            if p.tied:  # its elements are the untied piece's, read once (through that one)
                continue
            for up, chunk in chunks.get(p.canonical, ()):
                inter = up.intersect(p.canonical_box) if up.ndim else up
                if inter is None:
                    continue
                parts = (
                    unlift_parts(inter, steps[p.canonical])
                    if p.canonical in steps
                    else ((inter, inter),)
                )
                reads.extend(
                    ReadPiece(
                        canonical=p.canonical,
                        box=box,
                        chunk=chunk,
                        tensor=lt.name,
                        local_box=p.local_of(part),
                    )
                    for part, box in parts
                )
    return LoadPlan(rank=rank, reads=tuple(reads), padding=tuple(padding), views=lifted.views)
