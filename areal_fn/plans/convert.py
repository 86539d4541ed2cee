"""Conversion = materialising a layout's pieces from canonical tensors, and back.

``to_megatron`` (any layout, not only Megatron's) builds one rank's local tensors
from canonical (HF) tensors; ``to_hf`` writes every rank's local tensors back into
canonical tensors. Both are exact: pieces copy bytes, padding is zero on the way in
and dropped on the way out. Streaming forms take a *reader* (``read(name, box)``)
so that only the slices a rank needs are ever loaded, and yield one tensor at a time.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from areal_fn.errors import ConversionError
from areal_fn.layouts.layout import Layout, LocalTensor, Piece
from areal_fn.model.families import TEXT_CONFIG_TYPES
from areal_fn.model.tensor_spec import TensorSpec, torch_dtype
from areal_fn.plans.tensor_check import check_local_tensors, diff_shapes, listing
from areal_fn.sharding.box import Box
from areal_fn.sharding.strided import view_slices
from areal_fn.typecheck import beartype

#: ``read(canonical_name, box) -> tensor of box.shape``.
Reader = Callable[[str, Box], Tensor]


def mapping_reader(canonical: Mapping[str, Tensor]) -> Reader:
    """A reader over in-memory canonical tensors."""

    def read(name: str, box: Box) -> Tensor:
        return canonical[name][box.slices()]

    return read


def check_canonical(
    canonical: Mapping[str, Tensor], specs: tuple[TensorSpec, ...], *, allow_missing: bool = False
) -> None:
    """Raise ``ConversionError`` listing missing, extra and mis-shaped tensors."""
    d = diff_shapes(
        {s.name: s.shape for s in specs}, {n: tuple(t.shape) for n, t in canonical.items()}
    )
    problems = []
    if d.missing and not allow_missing:
        problems.append(f"missing {len(d.missing)}: {listing(d.missing)}")
    if d.unexpected:
        problems.append(f"unexpected {len(d.unexpected)}: {listing(d.unexpected)}")
    if d.misshaped:
        shapes = [f"{n}: got {g}, expected {w}" for n, g, w in d.misshaped]
        problems.append(f"mis-shaped {len(shapes)}: {listing(shapes)}")
    if problems:
        raise ConversionError(
            "canonical tensors do not match the model: "
            + "; ".join(problems)
            + ". Nothing is dropped, added or "
            "reshaped silently: fix the checkpoint or pass the model it belongs to"
            + _unexpected_hint(d.unexpected, specs)
        )


def _unexpected_hint(unexpected: Sequence[str], specs: tuple[TensorSpec, ...]) -> str:
    """What unexpected names usually mean: quantised weights, multi-token-prediction layers."""
    hints = []
    if any(n.endswith("weight_scale_inv") for n in unexpected):
        hints.append(
            "; the checkpoint holds FP8 weights ('weight_scale_inv') its config.json does not "
            "declare: block FP8 is read, dequantised, when config.json's quantization_config "
            "says quant_method fp8 (put the config.json published with the weights beside them)"
        )
    if any(n.endswith(("_blocks", "_scales")) for n in unexpected):
        hints.append(
            "; the checkpoint holds MXFP4 weights ('_blocks'/'_scales') its config.json does "
            "not declare: gpt-oss's MXFP4 experts are read, dequantised, when config.json's "
            "quantization_config says quant_method mxfp4 (put the config.json published with "
            "the weights beside them)"
        )
    hints.append(_wrapped_hint(unexpected))
    layers = {n.split(".")[2] for n in (s.name for s in specs) if n.startswith("model.layers.")}
    extra = sorted(
        {n.split(".")[2] for n in unexpected if n.startswith("model.layers.")} - layers, key=int
    )
    if extra:
        hints.append(
            f"; layers {extra} are beyond num_hidden_layers (multi-token-prediction layers, "
            "num_nextn_predict_layers, are not part of the model transformers builds): read "
            "the model with model_from_hf_config(config, mtp=True) to hold them (inference "
            "and megatron layouts carry them, fsdp refuses them), or leave them out with "
            "drop_mtp=True (HfCheckpoint.check, convert_to_local, convert_to_torch_dist)"
        )
    return "".join(hints)


def _wrapped_hint(unexpected: Sequence[str]) -> str:
    """What names of a multimodal checkpoint's text model (``TEXT_CONFIG_TYPES``) mean."""
    kinds = [
        (t, old)
        for t in TEXT_CONFIG_TYPES
        for old, _ in t.renamed
        if any(n.startswith(old) for n in unexpected)
    ]
    if not kinds:
        return ""
    prefixes = ", ".join(sorted({repr(old) for _, old in kinds}))
    types = ", ".join(dict.fromkeys(t.model_type for t, _ in kinds))
    return (
        f"; the checkpoint names its tensors as a multimodal model stores its text model "
        f"({prefixes}), read as that text model when config.json is the published one "
        f"(model_type {types}): put it beside the weights"
    )


def _taken(src: Tensor, p: Piece, origin: tuple[int, ...]) -> Tensor:
    """The elements of piece ``p`` in ``src``, the tensor of a canonical box starting at
    ``origin`` that contains the piece's: a slice, strided and permuted for a piece with a
    view (:mod:`areal_fn.sharding.strided`)."""
    box = p.canonical_region
    assert box is not None
    rel = Box._trusted(
        tuple((lo - o, hi - o) for (lo, hi), o in zip(box.ranges, origin, strict=True))
    )
    if p.view is None:
        return src[rel.slices()]
    return src[view_slices(rel, p.view)].permute(p.view.perm)


def _read_pieces(read: Reader, local: LocalTensor) -> list[tuple[Piece, Tensor]]:
    """Each non-padding piece of ``local`` with its canonical elements, read through
    ``read``: a plain piece reads its box; the strided pieces of one canonical tensor
    (gpt-oss gate and up columns) read the box around all of them once."""
    strided: dict[str, Box] = {}
    for p in local.pieces:
        if p.view is not None and p.canonical is not None and p.canonical_region is not None:
            b = strided.get(p.canonical, p.canonical_region)
            strided[p.canonical] = Box._trusted(
                tuple(
                    (min(a0, b0), max(a1, b1))
                    for (a0, a1), (b0, b1) in zip(b.ranges, p.canonical_region.ranges, strict=True)
                )
            )
    cache = {n: _read_box(read, n, box, local.name) for n, box in strided.items()}
    out = []
    for p in local.pieces:
        if p.canonical is None or p.canonical_region is None:
            continue
        if p.view is None:
            src = _read_box(read, p.canonical, p.canonical_region, local.name)
            out.append((p, src))
        else:
            out.append((p, _taken(cache[p.canonical], p, strided[p.canonical].start)))
    return out


def _read_box(read: Reader, name: str, box: Box, local: str) -> Tensor:
    src = read(name, box)
    if tuple(src.shape) != box.shape:
        raise ConversionError(
            f"{local}: reader returned shape {tuple(src.shape)} for {name}{box}, expected "
            f"{box.shape}"
        )
    return src


def canonical_region(t: Tensor, p: Piece) -> Tensor:
    """The view of canonical tensor ``t`` holding piece ``p``'s elements (strided and
    permuted for a piece with a view); writing into it writes into ``t``."""
    box = p.canonical_region
    assert box is not None
    if p.view is None:
        return t[box.slices()]
    return t[view_slices(box, p.view)].permute(p.view.perm)


def materialize(local: LocalTensor, read: Reader, *, dtype: torch.dtype | None = None) -> Tensor:
    """One local tensor from its pieces (padding zero).

    Without ``dtype`` the result keeps the canonical tensors' dtype (they must agree:
    nothing is cast silently); with ``dtype`` it is cast explicitly.
    """
    reads = _read_pieces(read, local)
    dtypes = {src.dtype for _, src in reads}
    if dtype is None and len(dtypes) > 1:
        raise ConversionError(
            f"{local.name} fuses canonical tensors of several dtypes {sorted(map(str, dtypes))}; pass dtype= to cast explicitly"
        )
    target = dtype or (dtypes.pop() if dtypes else torch_dtype(local.dtype))
    out = torch.zeros(local.shape, dtype=target)
    check_tied(local.name, reads)
    for p, src in reads:
        if not p.tied:
            region = out[p.local_box.slices()]
            region.copy_(src.reshape(region.shape))
    return out


def check_tied(name: str, reads: Sequence[tuple[Piece, Tensor]]) -> None:
    """``ConversionError`` unless every tied piece's canonical elements (a second tensor
    held in the same elements, :class:`~areal_fn.layouts.layout.FusionPiece`) equal, bit
    for bit, those of the untied piece at its local box."""
    main = {p.local_box: (p, src) for p, src in reads if not p.tied}
    for p, src in reads:
        if not p.tied:
            continue
        q, held = main[p.local_box]
        if src.dtype == held.dtype and torch.equal(
            src.reshape(-1).view(torch.uint8), held.reshape(-1).view(torch.uint8)
        ):
            continue
        raise ConversionError(
            f"{name} holds {p.canonical}{p.canonical_region} and {q.canonical}"
            f"{q.canonical_region} in the same elements (Megatron-Core's multi-token-prediction "
            f"layer uses the main model's embedding and output layer), so they must be equal, "
            f"and they differ; convert to an inference layout (sglang, vllm), which holds them "
            f"apart, or read the checkpoint without its multi-token-prediction layers "
            f"(drop_mtp=True)"
        )


@beartype
def iter_to_megatron(
    source: "Mapping[str, Tensor] | Reader",
    layout: Layout,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``rank``'s local tensors one by one (name, tensor), in layout order.

    Tensors keep the canonical dtype unless ``dtype`` asks for a cast.
    """
    if isinstance(source, Mapping):
        check_canonical(source, layout.canonical)
        read = mapping_reader(source)
    else:
        read = source
    for lt in layout.local_tensors(rank):
        yield lt.name, materialize(lt, read, dtype=dtype)


@beartype
def to_megatron(
    source: "Mapping[str, Tensor] | Reader",
    layout: Layout,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """``rank``'s local state dict under ``layout`` from canonical tensors (no cast unless ``dtype``)."""
    return dict(iter_to_megatron(source, layout, rank, dtype=dtype))


@beartype
def iter_to_hf(
    states: Mapping[int, Mapping[str, Tensor]],
    layout: Layout,
    *,
    check_replicas: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """Yield canonical tensors one by one, in checkpoint order, from every rank's state.

    Each element comes from the first rank holding it (rank order); with
    ``check_replicas`` every other copy is compared bitwise and a difference raises
    ``ConversionError`` naming the tensor and ranks.
    """
    check_local_tensors(
        layout,
        {r: {n: tuple(t.shape) for n, t in st.items()} for r, st in states.items()},
        error=ConversionError,
        every_rank=True,
    )
    holders: dict[str, list[tuple[int, str, Piece]]] = {}
    for r in range(layout.world_size):
        for lt in layout.local_tensors(r):
            for p in lt.pieces:
                if p.canonical is not None:
                    holders.setdefault(p.canonical, []).append((r, lt.name, p))
    for spec in layout.canonical:
        hs = holders.get(spec.name, [])
        out_dtype = states[hs[0][0]][hs[0][1]].dtype if hs else torch_dtype(spec.dtype)
        out = torch.empty(spec.shape, dtype=out_dtype)
        written = torch.zeros(spec.shape, dtype=torch.bool)
        for r, name, p in hs:
            region = canonical_region(out, p)
            seen = canonical_region(written, p)
            src = states[r][name][p.local_box.slices()].reshape(region.shape)
            if check_replicas and bool(seen.any()):
                a = region[seen].contiguous()
                b = src.to(region.dtype)[seen].contiguous()
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    raise ConversionError(
                        f"{spec.name}{p.canonical_region}: rank {r} ({name}) disagrees with an "
                        "earlier replica"
                    )
            fresh = ~seen
            if bool(fresh.all()):
                region.copy_(src)
            else:
                region.copy_(torch.where(fresh, src.to(region.dtype), region))
            seen.fill_(True)
        if not bool(written.all()):
            raise ConversionError(
                f"{spec.name}: {int((~written).sum())} of {written.numel()} elements are held by no rank of the "
                f"{layout.kind} layout; cannot export a partial tensor"
            )
        yield spec.name, out


@beartype
def to_hf(
    states: Mapping[int, Mapping[str, Tensor]], layout: Layout, *, check_replicas: bool = False
) -> dict[str, Tensor]:
    """Canonical (HF checkpoint) tensors from every rank's local state dict."""
    return dict(iter_to_hf(states, layout, check_replicas=check_replicas))


# ------------------------------------------------------------ into existing tensors


def _target_problems(layout: Layout, rank: int, out: Mapping[str, Tensor]) -> list[str]:
    """What keeps ``out`` from holding ``rank``'s local tensors: names, shapes, storage."""
    d = diff_shapes(
        {lt.name: lt.shape for lt in layout.local_tensors(rank)},
        {n: tuple(t.shape) for n, t in out.items()},
    )
    problems = []
    if d.missing:
        problems.append(f"no destination for {len(d.missing)}: {listing(d.missing)}")
    if d.unexpected:
        problems.append(
            f"{len(d.unexpected)} destination(s) the rank does not hold: {listing(d.unexpected)}"
        )
    if d.misshaped:
        shapes = [f"{n}: destination {g}, layout {w}" for n, g, w in d.misshaped]
        problems.append(f"mis-shaped {len(shapes)}: {listing(shapes)}")
    meta = [n for n, t in out.items() if t.is_meta]
    if meta:
        problems.append(
            f"{len(meta)} on the meta device (no storage): {listing(meta)}; allocate them first "
            "(module.to_empty(device=...))"
        )
    return problems


def _dtype_problems(
    layout: Layout, rank: int, out: Mapping[str, Tensor], dtypes: Mapping[str, torch.dtype]
) -> list[str]:
    """``"name: canonical X -> destination Y"`` for every piece whose dtypes differ."""
    bad: dict[str, str] = {}
    for lt in layout.local_tensors(rank):
        for p in lt.pieces:
            if p.canonical is not None and dtypes[p.canonical] != out[lt.name].dtype:
                bad.setdefault(
                    lt.name,
                    f"{lt.name}: {p.canonical} is {dtypes[p.canonical]}, the destination "
                    f"{out[lt.name].dtype}",
                )
    return list(bad.values())


@beartype
def check_into(
    layout: Layout,
    rank: int,
    out: Mapping[str, Tensor],
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    cast: bool = False,
) -> None:
    """``ConversionError`` unless ``out`` can hold ``rank``'s local tensors as they are.

    ``out`` must have exactly the rank's local tensor names, the layout's shapes and
    real storage (any device but ``meta``); with canonical ``dtypes`` given and
    without ``cast``, every destination the dtype of the canonical tensors it holds.
    """
    problems = _target_problems(layout, rank, out)
    if not problems and dtypes is not None and not cast:
        bad = _dtype_problems(layout, rank, out, dtypes)
        if bad:
            problems.append(
                f"dtypes differ for {len(bad)}: {listing(bad)}; pass cast=True to cast into "
                "the destinations' dtypes"
            )
    if problems:
        raise ConversionError(
            f"the destination tensors cannot hold rank {rank}'s local tensors of the "
            f"{layout.kind} layout: " + "; ".join(problems) + ". Pass the rank's tensors by "
            "layout name (layout.local_tensors(rank)), allocated with the layout's shapes"
        )


def _copy_piece(region: Tensor, src: Tensor, p: Piece, name: str, *, cast: bool) -> None:
    """Copy ``src`` (piece ``p``'s elements, :func:`_read_piece`) into ``region``."""
    if src.dtype != region.dtype and not cast:
        raise ConversionError(
            f"{name}: {p.canonical} is {src.dtype}, the destination {region.dtype}; pass "
            "cast=True to cast into the destination's dtype"
        )
    region.copy_(src.reshape(region.shape))


@beartype
def to_megatron_into(
    source: "Mapping[str, Tensor] | Reader",
    layout: Layout,
    rank: int,
    *,
    out: Mapping[str, Tensor],
    cast: bool = False,
) -> int:
    """Write ``rank``'s local tensors into the existing tensors ``out`` (name -> tensor).

    The ``out=`` form of :func:`to_megatron`: each piece is copied from the canonical
    slice straight into its view of the destination (``copy_``; padding zeroed), so
    nothing but what ``source`` returns is allocated, and a mapping of tensors (or of
    zero-copy views of files) is read without any copy of its own. Destinations keep
    their dtype: without ``cast`` it must be the canonical one. Everything that can be
    checked is checked before the first write (:func:`check_into`; a reader's dtypes
    and shapes only as it returns them). Returns the bytes written.
    """
    if isinstance(source, Mapping):
        check_canonical(source, layout.canonical)
        dtypes: dict[str, torch.dtype] | None = {n: t.dtype for n, t in source.items()}
        read = mapping_reader(source)
    else:
        dtypes, read = None, source
    check_into(layout, rank, out, dtypes=dtypes, cast=cast)
    with torch.no_grad():
        for lt in layout.local_tensors(rank):
            dest = out[lt.name]
            for p in lt.pieces:
                if p.canonical is None:
                    dest[p.local_box.slices()].zero_()
            reads = _read_pieces(read, lt)
            check_tied(lt.name, reads)
            for p, src in reads:
                if not p.tied:
                    _copy_piece(dest[p.local_box.slices()], src, p, lt.name, cast=cast)
    return _nbytes(layout, rank, out)


def _nbytes(layout: Layout, rank: int, out: Mapping[str, Tensor]) -> int:
    """Bytes of ``rank``'s local tensors in ``out``."""
    return sum(
        out[lt.name].numel() * out[lt.name].element_size() for lt in layout.local_tensors(rank)
    )


def pieces_into(
    layout: Layout, rank: int, out: Mapping[str, Tensor]
) -> Iterator[tuple[str, Tensor, Piece]]:
    """``(local name, view of the destination in out, piece)`` for every piece of
    ``rank``'s local tensors, in layout order (check ``out`` with :func:`check_into`)."""
    for lt in layout.local_tensors(rank):
        dest = out[lt.name]
        for p in lt.pieces:
            yield lt.name, dest[p.local_box.slices()], p
