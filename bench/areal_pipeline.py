"""AReaL's pipeline split, restated: the baseline of ``bench_pipeline`` (not a benchmark).

This module restates two functions of AReaL's
``areal/engine/megatron_utils/pipeline_parallel.py`` (inclusionAI/AReaL, commit
``4aef98d8d818af55b43621aaadba047ae10f4e77``) without their Megatron and
transformers imports:

- :func:`areal_stage_layer_lengths` is AReaL's algorithm ``_compute_stage_layer_lengths``,
  the same dynamic program with the same loops and the same problem. It uses ``dp[stage][end]``
  over every ``end`` in ``0..L`` and every ``start`` in ``0..end``, so ``O(K L^2)``. The
  first stage carries the embedding and the last the output layer; the first and the
  last stage may be empty (``start == end``), an inner stage may not. Ties go to the
  smallest ``start``. It returns ``[]`` when no split exists (AReaL then logs a warning
  and keeps Megatron's default split).
- :func:`areal_parameter_buckets` is AReaL's cost model ``estimate_stage_parameter_buckets``
  on an HF ``config.json`` dict, with the Megatron ``TransformerConfig`` fields it reads
  given as arguments.

:func:`areal_dp_numpy` solves the same problem with each stage's ``(end, start)``
table vectorised: the same ``O(K L^2)`` work, a harder baseline than the Python loops.
"""

import math
from collections.abc import Mapping, Sequence

import numpy as np

AREAL_SOURCE = (
    "inclusionAI/AReaL areal/engine/megatron_utils/pipeline_parallel.py "
    "@ 4aef98d8d818af55b43621aaadba047ae10f4e77"
)


def areal_stage_layer_lengths(
    layer_param_weights: Sequence[float],
    embedding_params: float,
    output_params: float,
    pp_size: int,
) -> list[int]:
    """AReaL's ``_compute_stage_layer_lengths``, restated line by line (``pp_size`` is
    AReaL's ``total_stages = pp * vpp``)."""
    total_layers = len(layer_param_weights)
    if total_layers == 0 or pp_size <= 0:
        return []

    prefix_sums = [0.0]
    for value in layer_param_weights:
        prefix_sums.append(prefix_sums[-1] + float(value))

    def segment_sum(start: int, end: int) -> float:
        return prefix_sums[end] - prefix_sums[start]

    stages = pp_size
    dp = [[math.inf] * (total_layers + 1) for _ in range(stages + 1)]
    choice = [[-1] * (total_layers + 1) for _ in range(stages + 1)]
    dp[0][0] = 0.0

    for stage in range(1, stages + 1):
        base = 0.0
        if stage == 1:
            base = embedding_params
        elif stage == stages:
            base = output_params

        for end in range(0, total_layers + 1):
            for start in range(0, end + 1):
                prev = dp[stage - 1][start]
                if not math.isfinite(prev):
                    continue
                if stage not in (1, stages) and start == end:
                    continue
                load = base + segment_sum(start, end)
                candidate = max(prev, load)
                if candidate < dp[stage][end]:
                    dp[stage][end] = candidate
                    choice[stage][end] = start

    if not math.isfinite(dp[stages][total_layers]):
        return []

    lengths = [0] * stages
    idx = total_layers
    for stage in range(stages, 0, -1):
        split = choice[stage][idx]
        if split < 0:
            return []
        lengths[stage - 1] = idx - split
        idx = split

    return lengths


def areal_loads(
    layer_param_weights: Sequence[float],
    embedding_params: float,
    output_params: float,
    lengths: Sequence[int],
) -> list[float]:
    """Stage loads as AReaL defines them: the embedding on stage 0, the output layer on
    the last stage (AReaL logs these after the split)."""
    loads, cursor = [], 0
    for idx, n in enumerate(lengths):
        load = math.fsum(layer_param_weights[cursor : cursor + n])
        cursor += n
        load += embedding_params if idx == 0 else 0.0
        load += output_params if idx == len(lengths) - 1 else 0.0
        loads.append(load)
    return loads


def areal_dp_numpy(
    costs: Sequence[float], k: int, first_extra: float, last_extra: float
) -> tuple[float, tuple[int, ...]]:
    """AReaL's problem (empty first and last stage allowed, inner stages not) by the
    same dynamic program, each stage's ``(end, start)`` table vectorised with numpy.
    Returns (bottleneck, lengths); ties go to the smallest start, as in AReaL."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0
    choices = []
    starts = np.arange(n + 1)
    block = max(1, 4_000_000 // (n + 1))
    for s in range(1, k + 1):
        base = first_extra if s == 1 else last_extra if s == k else 0.0
        open_end = s in (1, k)
        row = np.full(n + 1, np.inf)
        pick = np.full(n + 1, -1)
        for lo in range(0, n + 1, block):
            ends = np.arange(lo, min(lo + block, n + 1))
            cand = np.maximum(prev[None, :], prefix[ends, None] + base - prefix[None, :])
            bad = starts[None, :] > ends[:, None] if open_end else starts[None, :] >= ends[:, None]
            cand[bad] = np.inf
            arg = np.argmin(cand, axis=1)
            row[ends] = cand[np.arange(len(ends)), arg]
            pick[ends] = arg
        prev = row
        choices.append(pick)
    lengths = []
    end = n
    for s in range(k, 0, -1):
        start = int(choices[s - 1][end])
        lengths.append(end - start)
        end = start
    return float(prev[n]), tuple(reversed(lengths))


def areal_parameter_buckets(
    hf: Mapping[str, object],
    *,
    num_moe_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
    moe_layer_freq: int | Sequence[int] = 1,
    expert_model_parallel_size: int = 1,
    gated_linear_unit: bool = True,
    add_bias_linear: bool = False,
    moe_router_enable_expert_bias: bool = False,
    moe_shared_expert_intermediate_size: int | None = None,
) -> tuple[list[float], float, float]:
    """AReaL's ``estimate_stage_parameter_buckets`` on an HF ``config.json`` dict.

    The keyword arguments are the ``TransformerConfig`` fields AReaL reads, set as
    Megatron-Core's config for a SwiGLU model without linear biases sets them. As in
    AReaL, ``o_proj`` counts ``hidden * hidden``, the q/k norms are not counted, qkv
    biases only when the HF config has ``attention_bias``, the output layer has no
    norm, and ``moe_layer_freq=N`` makes layers ``N-1, 2N-1, ...`` MoE.
    """
    total_layers = int(hf["num_hidden_layers"])  # type: ignore[call-overload]
    h = int(hf["hidden_size"])  # type: ignore[call-overload]
    inter = int(hf.get("intermediate_size", h * 4))  # type: ignore[call-overload]
    heads = int(hf.get("num_attention_heads", 1))  # type: ignore[call-overload]
    kv_heads = int(hf.get("num_key_value_heads", heads))  # type: ignore[call-overload]
    head_dim = hf.get("head_dim") or h // max(heads, 1)
    head_dim = int(head_dim)  # type: ignore[call-overload]
    attention_bias = bool(hf.get("attention_bias", False) or add_bias_linear)

    def mlp_params(intermediate: int | None) -> float:
        if not intermediate or intermediate <= 0:
            return 0.0
        gate = h * intermediate if gated_linear_unit else 0.0
        bias = ((2 if gated_linear_unit else 1) * intermediate + h) if add_bias_linear else 0.0
        return float(h * intermediate + gate + intermediate * h + bias)

    kv = kv_heads * head_dim
    attn_bias = (heads * head_dim + 2 * kv + h) if attention_bias else 0.0
    attn_and_norm = h * heads * head_dim + 2 * h * kv + h * h + attn_bias + 2.0 * h
    weights = [float(attn_and_norm + mlp_params(inter))] * total_layers
    vocab = int(hf.get("vocab_size", 0))  # type: ignore[call-overload]
    embedding = float(vocab * h) + (float(vocab) if hf.get("embedding_bias", False) else 0.0)
    output = embedding if hf.get("tie_word_embeddings", False) else float(vocab * h)
    if num_moe_experts:
        moe_h = moe_ffn_hidden_size or hf.get("moe_intermediate_size") or inter
        local = math.ceil(num_moe_experts / max(expert_model_parallel_size, 1))
        router = h * num_moe_experts + (num_moe_experts if moe_router_enable_expert_bias else 0)
        shared = mlp_params(moe_shared_expert_intermediate_size)
        moe = float(attn_and_norm + router + mlp_params(int(moe_h)) * local + shared)  # type: ignore[call-overload]
        if isinstance(moe_layer_freq, int):
            step = abs(moe_layer_freq)
            picked = range(step - 1, total_layers, step)
        else:
            picked = [i for i, m in enumerate(moe_layer_freq) if m]
        for i in picked:
            weights[i] = moe
    return weights, embedding, output
