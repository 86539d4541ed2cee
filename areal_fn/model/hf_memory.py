"""The transformers 5 in-memory layout of a model, and exact state-dict conversion.

transformers 5 keeps some checkpoint tensors fused in memory: Qwen3-MoE stacks its
experts into ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (expert ``e`` is
``[gate_e; up_e]``) and ``mlp.experts.down_proj`` ``[E, H, I]``, while its checkpoint
(and ``save_pretrained``) holds one tensor per expert (the family's ``fused_experts``);
some it keeps under another name (the family's ``memory_names``: Mixtral's router). Tied models also expose
``lm_head.weight`` in their state dict, an alias of ``model.embed_tokens.weight``.

:func:`hf_memory_view` describes every in-memory tensor (in ``model.state_dict()``
order) as pieces ``(canonical name, box in canonical coordinates, box in memory
coordinates)``. A piece's two boxes hold the same number of elements and the data maps
by a row-major reshape: ``memory[memory_box] = canonical[canonical_box].reshape(...)``
(a stacked expert's memory box has a leading expert dim of extent 1). Here every piece
covers a whole canonical tensor.

:func:`hf_state_to_canonical` and :func:`canonical_to_hf_state` apply that view to torch
tensors, bitwise exactly. They may return tensors that share storage with their input.
"""

import functools
import re
from collections.abc import Iterable, Mapping

import attrs
import torch

from areal_fn.errors import ConversionError, SpecError
from areal_fn.model.spec import ModelSpec, layer_of
from areal_fn.model.tensor_spec import dtype_name
from areal_fn.sharding.box import Box
from areal_fn.typecheck import beartype


@attrs.frozen(kw_only=True)
class MemoryPiece:
    """Canonical tensor ``canonical``'s ``canonical_box`` lives at ``memory_box``."""

    canonical: str
    canonical_box: Box
    memory_box: Box

    def __attrs_post_init__(self) -> None:
        if self.canonical_box.numel != self.memory_box.numel:
            raise SpecError(
                f"piece of {self.canonical!r}: canonical box {self.canonical_box} has "
                f"{self.canonical_box.numel} elements, memory box {self.memory_box} has "
                f"{self.memory_box.numel}; a piece maps equal numbers of elements"
            )


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _pieces(value: Iterable[MemoryPiece]) -> tuple[MemoryPiece, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class MemoryTensor:
    """One tensor of ``model.state_dict()`` and the canonical pieces it holds."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    dtype: str = attrs.field(converter=dtype_name)
    pieces: tuple[MemoryPiece, ...] = attrs.field(converter=_pieces)
    #: A persistent buffer of the module (saved, not trained), not a parameter.
    buffer: bool = False

    @property
    def is_fused(self) -> bool:
        """True when this tensor is not simply one canonical tensor under its own name."""
        if len(self.pieces) != 1:
            return True
        p = self.pieces[0]
        return p.canonical != self.name or p.memory_box.shape != self.shape


def _whole(
    name: str, shape: tuple[int, ...], dtype: str, source: str | None = None, buffer: bool = False
) -> MemoryTensor:
    box = Box.full(shape)
    piece = MemoryPiece(canonical=source or name, canonical_box=box, memory_box=box)
    return MemoryTensor(name=name, shape=shape, dtype=dtype, pieces=(piece,), buffer=buffer)


def _fused(spec: ModelSpec, layer: int) -> list[MemoryTensor]:
    prefix = f"model.layers.{layer}."
    out = []
    for group in spec.family.fused_experts:
        cd = group.concat_dim
        part_shapes = [spec.tensor(prefix + part.format(e=0)).shape for part in group.parts]
        per_expert = list(part_shapes[0])
        per_expert[cd] = sum(shape[cd] for shape in part_shapes)
        pieces = []
        for e in range(spec.num_experts):
            offset = 0
            for part, shape in zip(group.parts, part_shapes, strict=True):
                ranges = [(e, e + 1)] + [(0, d) for d in shape]
                ranges[1 + cd] = (offset, offset + shape[cd])
                offset += shape[cd]
                pieces.append(
                    MemoryPiece(
                        canonical=prefix + part.format(e=e),
                        canonical_box=Box.full(shape),
                        memory_box=Box(ranges=tuple(ranges)),
                    )
                )
        shape = (spec.num_experts, *per_expert)
        out.append(
            MemoryTensor(name=prefix + group.name, shape=shape, dtype=spec.dtype, pieces=pieces)
        )
    return out


@beartype
def hf_memory_view(spec: ModelSpec) -> tuple[MemoryTensor, ...]:
    """Every tensor of the transformers 5 ``model.state_dict()``, in its order, as pieces."""
    return _memory_view(spec)


@functools.lru_cache(maxsize=16)
def _memory_view(spec: ModelSpec) -> tuple[MemoryTensor, ...]:
    out: list[MemoryTensor] = []
    fused_layers: set[int] = set()
    fam = spec.family
    parts = tuple(
        re.compile(re.escape(p).replace(re.escape("{e}"), r"\d+") + "$")
        for group in fam.fused_experts
        for p in group.parts
    )
    renames = dict(fam.memory_names)
    buffers = {r.name for r in fam.canonical if r.buffer}
    for t in spec.tensors:
        layer = layer_of(t.name)
        if layer is None:
            out.append(_whole(t.name, t.shape, t.dtype))
            continue
        rel = t.name[len(f"model.layers.{layer}.") :]
        if any(p.match(rel) for p in parts):
            if layer not in fused_layers:
                fused_layers.add(layer)
                out.extend(_fused(spec, layer))
            continue
        if rel in renames:
            name = f"model.layers.{layer}.{renames[rel]}"
            out.append(_whole(name, t.shape, t.dtype, source=t.name, buffer=rel in buffers))
            continue
        out.append(_whole(t.name, t.shape, t.dtype, buffer=rel in buffers))
    if spec.tie_word_embeddings:
        outer = spec.family.outer
        embed = spec.tensor(outer.embedding)
        out.append(_whole(outer.output, embed.shape, embed.dtype, source=embed.name))
    return tuple(out)


def _check_names(
    have: Mapping[str, torch.Tensor], want: list[str], what: str, spec: ModelSpec
) -> None:
    missing = [n for n in want if n not in have]
    wanted = set(want)
    extra = [n for n in have if n not in wanted]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) {missing[:5]}")
        if extra:
            parts.append(f"{len(extra)} unexpected tensor(s) {extra[:5]}")
        raise ConversionError(
            f"{what} does not match the {spec.model_type} spec: {'; '.join(parts)}; pass "
            f"exactly the {len(want)} tensors the spec lists (same config, same transformers "
            f"layout)"
        )


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ConversionError(
            f"{what} tensor {name!r} has shape {tuple(tensor.shape)}, the spec says {shape}; "
            f"was it built from a different config?"
        )


@beartype
def hf_state_to_canonical(
    state_dict: Mapping[str, torch.Tensor], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """Canonical (checkpoint) tensors, in ``spec.tensors`` order, from a transformers 5 state dict.

    Fused expert tensors are split per expert (views of the input). A tied model's
    ``lm_head.weight`` must equal ``model.embed_tokens.weight`` and is dropped.
    """
    view = hf_memory_view(spec)
    _check_names(state_dict, [m.name for m in view], "state_dict", spec)
    out: dict[str, torch.Tensor] = {}
    for m in view:
        src = state_dict[m.name]
        _check_shape(m.name, src, m.shape, "state_dict")
        for p in m.pieces:
            piece = src[p.memory_box.slices()].reshape(p.canonical_box.shape)
            if p.canonical in out:
                if not torch.equal(out[p.canonical], piece):
                    raise ConversionError(
                        f"{m.name!r} should alias {p.canonical!r} (tie_word_embeddings=True) "
                        f"but holds different values; untie the spec or re-tie the model"
                    )
                continue
            out[p.canonical] = piece
    return {t.name: out[t.name] for t in spec.tensors}


@beartype
def canonical_to_hf_state(
    canonical: Mapping[str, torch.Tensor], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """A transformers 5 state dict (``model.state_dict()`` order) from canonical tensors.

    Unfused tensors are passed through (the same tensor objects; a tied model's
    ``lm_head.weight`` is the embedding tensor); fused ones are new tensors.
    """
    names = list(spec.tensor_names)
    _check_names(canonical, names, "canonical tensors", spec)
    for t in spec.tensors:
        _check_shape(t.name, canonical[t.name], t.shape, "canonical")
    out: dict[str, torch.Tensor] = {}
    for m in hf_memory_view(spec):
        if len(m.pieces) == 1 and m.pieces[0].memory_box.shape == m.shape:
            out[m.name] = canonical[m.pieces[0].canonical].reshape(m.shape)
            continue
        srcs = [canonical[p.canonical] for p in m.pieces]
        kinds = {(s.dtype, s.device) for s in srcs}
        if len(kinds) != 1:
            raise ConversionError(
                f"{m.name!r} fuses {len(srcs)} canonical tensors with different dtypes/devices "
                f"{sorted(map(str, kinds))}; cast them to one dtype and device first"
            )
        dtype, device = kinds.pop()
        fused = torch.empty(m.shape, dtype=dtype, device=device)
        for p, s in zip(m.pieces, srcs, strict=True):
            fused[p.memory_box.slices()] = s[p.canonical_box.slices()].reshape(p.memory_box.shape)
        out[m.name] = fused
    return out
