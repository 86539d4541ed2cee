"""The load plan of a checkpoint: the stored boxes that fill one rank's local tensors.

:func:`plan_load` intersects a rank's local pieces with the stored chunks: the reads
that fill that rank's local tensors (padding is listed apart, to be zeroed). Pure: no
files, no ranks, no clock.
"""

import attrs

from areal_fn.errors import CheckpointError
from areal_fn.layouts.layout import Layout
from areal_fn.plans.checkpoint_manifest import CheckpointManifest, check_model
from areal_fn.plans.tensor_check import refuse_strided
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
    """What one rank reads: every non-padding local element exactly once."""

    rank: int
    reads: tuple[ReadPiece, ...]
    padding: tuple[PadPiece, ...]

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
    the layout's model (missing, extra, mis-shaped).
    """
    refuse_strided(
        layout,
        "checkpoint planning",
        "load into a layout without them (FSDP2), or read the canonical tensors and convert "
        "them (to_megatron_into)",
        CheckpointError,
    )
    check_model(manifest, layout.canonical)
    chunks = {
        t.name: sorted((c.box for c in t.chunks), key=lambda b: b.ranges) for t in manifest.tensors
    }
    reads: list[ReadPiece] = []
    padding: list[PadPiece] = []
    for lt in layout.local_tensors(rank):
        for p in lt.pieces:
            if p.canonical is None or p.canonical_box is None:
                padding.append(PadPiece(tensor=lt.name, local_box=p.local_box))
                continue
            for chunk in chunks[p.canonical]:
                inter = chunk.intersect(p.canonical_box) if chunk.ndim else chunk
                if inter is None:
                    continue
                reads.append(
                    ReadPiece(
                        canonical=p.canonical,
                        box=inter,
                        chunk=chunk,
                        tensor=lt.name,
                        local_box=p.local_of(inter),
                    )
                )
    return LoadPlan(rank=rank, reads=tuple(reads), padding=tuple(padding))
