"""Tensor parallelism over a gated delta net: each rank runs whole key-head groups.

A linear-attention layer (:mod:`areal_fn.model.linear_attention`) splits over ``tp``
as Megatron-Core's ``GatedDeltaNet`` and vLLM's Qwen3-Next / Qwen3.5 split it: rank
``r`` runs key heads ``r*k .. (r+1)*k`` (``k = key_heads / tp``) and the value heads they
serve, ``r*v .. (r+1)*v`` (``v = value_heads / tp``; value head ``j`` reads key head
``j // (value_heads / key_heads)``). So ``tp`` must divide ``key_heads``. Per tensor
(its :class:`~areal_fn.model.families.tp_role.TpRole` in the family's table):

- ``A_log``, ``dt_bias`` (one value per value head), ``in_proj_z`` / ``in_proj_b`` /
  ``in_proj_a`` (rows by value head) and Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``
  (rows grouped per key head, ``[q_g; k_g; v_g; z_g]``, ``[b_g; a_g]``): a contiguous
  split of the rows;
- ``conv1d`` and Qwen3.5's ``in_proj_qkv``: rows ``[q; k; v]``, every key head's queries,
  then their keys, then every value head's values: rank ``r`` holds the three row ranges
  :func:`delta_qkv_rows` gives;
- ``out_proj``: its input columns by value head (row-wise); ``norm`` (of one value head)
  whole on every rank.
"""

from areal_fn.errors import LayoutError
from areal_fn.model.linear_attention import LinearAttention
from areal_fn.typecheck import beartype

__all__ = ["delta_local_heads", "delta_qkv_rows"]


@beartype
def delta_local_heads(la: LinearAttention, tp: int) -> tuple[int, int]:
    """``(key heads, value heads)`` each of ``tp`` ranks runs; ``LayoutError`` when ``tp``
    does not divide the key heads."""
    if tp < 1 or la.key_heads % tp:
        divisors = [d for d in range(1, la.key_heads + 1) if la.key_heads % d == 0]
        raise LayoutError(
            f"tp={tp} does not divide linear_num_key_heads={la.key_heads}; each tp rank runs "
            f"whole key-head groups of the linear-attention layers, use tp in {divisors}"
        )
    return la.key_heads // tp, la.value_heads // tp


@beartype
def delta_qkv_rows(la: LinearAttention, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` row ranges of ``[q; k; v]`` (``conv1d``, ``in_proj_qkv``) that
    ``rank`` of ``tp`` holds: its queries, its keys, its values, in that order."""
    if not 0 <= rank < tp:
        raise LayoutError(f"rank={rank} is not a rank of tp={tp}; use 0 <= rank < tp")
    k, v = delta_local_heads(la, tp)
    q_rows, v_rows = k * la.key_head_dim, v * la.value_head_dim
    return (
        (rank * q_rows, (rank + 1) * q_rows),
        (la.key_dim + rank * q_rows, la.key_dim + (rank + 1) * q_rows),
        (2 * la.key_dim + rank * v_rows, 2 * la.key_dim + (rank + 1) * v_rows),
    )
