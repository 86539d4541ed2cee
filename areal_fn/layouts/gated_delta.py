"""Fusion maps of the gated-delta-net families' Megatron-Core parameters (Qwen3-Next, Qwen3.5).

- Gated attention's ``linear_qkv`` (``Fusion.GATED_QKV``): per query group ``g``
  ``[q heads of g; their gates; k_g; v_g]``, each head ``head_dim`` rows, from
  transformers' ``q_proj`` whose head ``h`` is ``[q_h; gate_h]`` (Megatron-Core's
  ``attention_output_gate``). TP shards whole groups (``Shard(0)``), as for ``QKV``.
- ``GatedDeltaNet.in_proj`` (``Fusion.GDN_IN_PROJ``, ``GDN_IN_PROJ_SPLIT``): a
  ``ColumnParallelLinear`` whose TP rank ``r`` splits its own rows into
  ``[q_r; k_r; v_r; z_r; b_r; a_r]``, the queries and keys of its key heads
  ``r * K/tp ... (r + 1) * K/tp - 1`` and the values, output gates and the two scalars of
  the value heads those key heads serve. The logical tensor is the ranks' rows one after
  another (at ``tp = 1`` Megatron's whole ``[q; k; v; z; b; a]``), sharded ``Shard(0)``;
  its fusion map therefore depends on ``tp``. Qwen3-Next's sources hold the same rows per
  key-head group ``g``: ``in_proj_qkvz`` ``[q_g; k_g; v_g; z_g]``, ``in_proj_ba``
  ``[b_g; a_g]``; Qwen3.5's ``in_proj_qkv`` ``[q; k; v]`` (all heads of each in turn),
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. Value head ``j`` of key head ``g`` is
  head ``g * V/K + j`` on both sides.
- ``GatedDeltaNet.conv1d`` (``Fusion.GDN_CONV``): channels ``[q_r; k_r; v_r]`` per TP
  rank, from transformers' ``conv1d`` ``[q; k; v]``.

``A_log``, ``dt_bias`` (value heads, ``Shard(0)``), ``out_norm`` (replicated) and
``out_proj`` (``Shard(1)``) are whole copies: their value-head order is the same.
"""

from areal_fn.errors import LayoutError
from areal_fn.layouts.layout import FusionPiece
from areal_fn.model.linear_attention import LinearAttention
from areal_fn.model.spec import ModelSpec
from areal_fn.sharding.box import Box

__all__ = ["gated_qkv_fusion", "gdn_conv_fusion", "gdn_in_proj_fusion"]

Shaped = tuple[tuple[int, ...], tuple[FusionPiece, ...]]


def _rows(name: str, start: int, n: int, dst: int, cols: tuple[int, ...]) -> FusionPiece:
    rest = tuple((0, c) for c in cols)
    return FusionPiece(
        canonical=name,
        canonical_box=Box(ranges=((start, start + n), *rest)),
        logical_box=Box(ranges=((dst, dst + n), *rest)),
    )


def _laid(blocks: list[tuple[str, int, int]], cols: tuple[int, ...]) -> Shaped:
    """``(source, first row, rows)`` blocks laid one after another."""
    pieces, row = [], 0
    for name, start, n in blocks:
        pieces.append(_rows(name, start, n, row, cols))
        row += n
    return (row, *cols), tuple(pieces)


def gated_qkv_fusion(model: ModelSpec, sources: tuple[str, ...], cols: tuple[int, ...]) -> Shaped:
    """``linear_qkv`` of gated attention from canonical ``(q_proj, k_proj, v_proj)``."""
    hd, nq, nkv = model.head_dim, model.num_attention_heads, model.num_key_value_heads
    qpg = nq // nkv
    q, k, v = sources
    blocks = []
    for g in range(nkv):
        heads = range(g * qpg, (g + 1) * qpg)
        blocks += [(q, 2 * h * hd, hd) for h in heads]  # the queries
        blocks += [(q, (2 * h + 1) * hd, hd) for h in heads]  # their gates
        blocks += [(k, g * hd, hd), (v, g * hd, hd)]
    return _laid(blocks, cols)


def _linear(model: ModelSpec, tp: int) -> LinearAttention:
    la = model.linear_attention
    if la is None:
        raise LayoutError(
            f"{model.model_type}: a gated-delta-net fusion in its Megatron table, but the model "
            "has no linear attention; fix the family's table (areal_fn/model/families/)"
        )
    if la.key_heads % tp:
        raise LayoutError(
            f"tp={tp} does not divide linear_num_key_heads={la.key_heads} ({model.model_type}); "
            "Megatron-Core's GatedDeltaNet gives every TP rank whole key heads"
        )
    return la


def _per_rank(
    la: LinearAttention, tp: int, parts: list[tuple[str, int, int, int]]
) -> list[tuple[str, int, int]]:
    """Rank by rank, each part's rows of the rank's key-head groups: a part is ``(source,
    offset, rows per key head, stride)``, key head ``g``'s rows starting at ``offset + g *
    stride``; consecutive key heads' rows are merged where they touch."""
    per = la.key_heads // tp
    out: list[tuple[str, int, int]] = []
    for r in range(tp):
        for name, offset, n, stride in parts:
            for g in range(r * per, (r + 1) * per):
                start = offset + g * stride
                last = out[-1] if out else None
                if last is not None and last[0] == name and last[1] + last[2] == start:
                    out[-1] = (name, last[1], last[2] + n)
                else:
                    out.append((name, start, n))
    return out


def gdn_in_proj_fusion(
    model: ModelSpec, sources: tuple[str, ...], cols: tuple[int, ...], *, tp: int
) -> Shaped:
    """``in_proj`` from Qwen3-Next's ``(in_proj_qkvz, in_proj_ba)`` or Qwen3.5's
    ``(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)``, laid for ``tp`` ranks."""
    la = _linear(model, tp)
    hk, r = la.key_head_dim, la.value_heads // la.key_heads
    hv = r * la.value_head_dim  # value rows per key head
    if len(sources) == 2:
        qkvz, ba = sources
        w = 2 * hk + 2 * hv
        parts = [(qkvz, 0, hk, w), (qkvz, hk, hk, w), (qkvz, 2 * hk, hv, w)]
        parts += [(qkvz, 2 * hk + hv, hv, w), (ba, 0, r, 2 * r), (ba, r, r, 2 * r)]
    else:
        qkv, z, b, a = sources
        parts = [(qkv, 0, hk, hk), (qkv, la.key_dim, hk, hk), (qkv, 2 * la.key_dim, hv, hv)]
        parts += [(z, 0, hv, hv), (b, 0, r, r), (a, 0, r, r)]
    return _laid(_per_rank(la, tp, parts), cols)


def gdn_conv_fusion(model: ModelSpec, source: str, cols: tuple[int, ...], *, tp: int) -> Shaped:
    """``conv1d`` channels from transformers' ``conv1d`` ``[q; k; v]``, laid for ``tp`` ranks."""
    la = _linear(model, tp)
    hk, hv = la.key_head_dim, la.value_heads // la.key_heads * la.value_head_dim
    parts = [(source, 0, hk, hk), (source, la.key_dim, hk, hk), (source, 2 * la.key_dim, hv, hv)]
    return _laid(_per_rank(la, tp, parts), cols)
