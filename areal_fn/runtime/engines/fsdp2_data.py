"""Canonical tensors into and out of a model's local shards, by a layout's pieces.

:func:`load_canonical` writes each rank's pieces into its local parameter shards (no
communication); :func:`export_canonical` gathers every rank's shards and writes them
back into canonical tensors. Both move data by the layout's pieces only, so both are
bitwise exact whenever the layout describes the data. Re-exported by
:mod:`areal_fn.runtime.engines.fsdp2_apply`.
"""

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from areal_fn.errors import ConversionError, LayoutError
from areal_fn.layouts.layout import Layout, LocalTensor
from areal_fn.runtime.engines.fsdp2_mesh import FSDP2MismatchError
from areal_fn.typecheck import beartype

__all__ = ["export_canonical", "layout_tensors", "load_canonical", "materialize_local"]


def layout_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a layout describes: the parameters and the persistent buffers (a router's
    score-correction bias), by their ``state_dict`` names."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    stored = set(model.state_dict())
    out.update({n: b for n, b in model.named_buffers() if n in stored})
    return out


def _canonical_source(canonical: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return canonical[name]
    except KeyError:
        raise ConversionError(
            f"canonical tensor {name!r} is missing; pass every canonical tensor of the model "
            "(hf_state_to_canonical(model.state_dict(), spec) gives them)"
        ) from None


def materialize_local(
    local: LocalTensor,
    canonical: Mapping[str, torch.Tensor],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``local`` filled from canonical tensors by its pieces (padding pieces zero).

    Writes into ``out`` (which must have ``local.shape``) when given, else a new tensor
    of the canonical dtype.
    """
    if out is None:
        first = next((p.canonical for p in local.pieces if p.canonical is not None), None)
        dtype = _canonical_source(canonical, first).dtype if first else getattr(torch, local.dtype)
        out = torch.zeros(local.shape, dtype=dtype)
    elif tuple(out.shape) != local.shape:
        raise ConversionError(
            f"{local.name}: the target holds shape {tuple(out.shape)}, the layout says "
            f"{local.shape}; the model and the layout disagree"
        )
    for piece in local.pieces:
        region = out[piece.local_box.slices()]
        if piece.canonical is None or piece.canonical_box is None:
            region.zero_()
            continue
        src = _canonical_source(canonical, piece.canonical)
        region.copy_(src[piece.canonical_box.slices()].reshape(piece.local_box.shape))
    return out


@beartype
def load_canonical(
    model: nn.Module, layout: Layout, rank: int, canonical: Mapping[str, torch.Tensor]
) -> None:
    """Write ``rank``'s pieces of the canonical tensors into its local parameter shards.

    ``canonical`` holds full canonical tensors (checkpoint names and shapes); each rank
    copies only its pieces (cast to the parameter dtype). No communication.
    """
    params = layout_tensors(model)
    with torch.no_grad():
        for local in layout.local_tensors(rank):
            param = params.get(local.name)
            if param is None:
                raise ConversionError(
                    f"layout tensor {local.name!r} is not a parameter or buffer of the model; apply the "
                    "same layout with apply_fsdp2 first"
                )
            target = param.to_local() if isinstance(param, DTensor) else param
            materialize_local(local, canonical, out=target)


@beartype
def export_canonical(
    model: nn.Module,
    layout: Layout,
    *,
    group: dist.ProcessGroup | None = None,
    check_replicas: bool = True,
) -> dict[str, torch.Tensor]:
    """Every canonical tensor, gathered from all ranks' local shards by the layout's pieces.

    Collective over ``group`` (default: the world, which the layout must cover): one
    all-gather per layout tensor, then each rank's pieces are written back into
    canonical tensors (CPU). Bitwise exact; with ``check_replicas`` replicas that
    disagree raise, and a canonical tensor not covered exactly raises.
    """
    world = dist.get_world_size(group)
    if world != layout.world_size:
        raise LayoutError(
            f"the {layout.kind} layout spans {layout.world_size} ranks, the group {world}"
        )
    params = layout_tensors(model)
    specs = {c.name: c for c in layout.canonical}
    out: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    locals_by_rank = [{lt.name: lt for lt in layout.local_tensors(r)} for r in range(world)]
    for t in layout.tensors:
        param = params.get(t.name)
        if param is None:
            raise ConversionError(
                f"layout tensor {t.name!r} is not a parameter or buffer of the model"
            )
        mine = param.to_local() if isinstance(param, DTensor) else param
        mine = mine.detach().contiguous().reshape(-1)
        sizes = [lt[t.name].numel if t.name in lt else 0 for lt in locals_by_rank]
        pad = max(sizes)
        buf = torch.zeros(pad, dtype=mine.dtype, device=mine.device)
        buf[: mine.numel()] = mine
        gathered = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(gathered, buf, group=group)
        for r in range(world):
            local = locals_by_rank[r].get(t.name)
            if local is None:
                continue
            data = gathered[r][: sizes[r]].reshape(local.shape).cpu()
            for piece in local.pieces:
                if piece.canonical is None or piece.canonical_box is None:
                    continue
                if piece.canonical not in out:
                    spec = specs[piece.canonical]
                    out[piece.canonical] = torch.empty(spec.shape, dtype=data.dtype)
                    written[piece.canonical] = torch.zeros(spec.shape, dtype=torch.bool)
                dst = out[piece.canonical][piece.canonical_box.slices()]
                seen = written[piece.canonical][piece.canonical_box.slices()]
                src = data[piece.local_box.slices()].reshape(piece.canonical_box.shape)
                if check_replicas and bool(seen.any()):
                    if not torch.equal(_bits(dst[seen]), _bits(src[seen])):
                        raise FSDP2MismatchError(
                            f"{piece.canonical} {piece.canonical_box}: rank {r}'s replica differs "
                            "from an earlier rank's; the replicas are out of sync"
                        )
                dst.copy_(src)
                seen.fill_(True)
    for c in layout.canonical:
        if c.name not in written or not bool(written[c.name].all()):
            held = 0 if c.name not in written else int(written[c.name].sum())
            raise ConversionError(
                f"the layout covers {held} of {math.prod(c.shape)} elements of {c.name!r}; "
                "every canonical element must lie in some rank's pieces"
            )
    return {c.name: out[c.name] for c in layout.canonical}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t
