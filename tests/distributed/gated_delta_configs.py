"""Tiny configs of the gated-delta-net families, shared by the FSDP2 oracle and the
gradient workers: three linear-attention layers and one gated full-attention layer
(``layer_types`` explicit, the full layer second), float32; Qwen3-Next and Qwen3.5-MoE
with routed experts and the gated shared expert (expert widths of 8 floats: transformers'
grouped GEMM wants 16-byte strides). :func:`rank_parts`: what each tensor-parallel rank
holds of a linear-attention layer, from the head counts alone."""

from collections.abc import Mapping

_BASE: dict[str, object] = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 52,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}

_MOE: dict[str, object] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 8,
}


def qwen3_next() -> dict[str, object]:
    return {**_BASE, **_MOE, "model_type": "qwen3_next", "mlp_only_layers": [2]}


def qwen3_5_text() -> dict[str, object]:
    return {**_BASE, "model_type": "qwen3_5_text"}


def qwen3_5_moe_text() -> dict[str, object]:
    out = {**_BASE, **_MOE, "model_type": "qwen3_5_moe_text"}
    del out["intermediate_size"]
    return out


def rank_parts(
    cfg: Mapping[str, object], tp: int, r: int
) -> dict[str, tuple[int, int] | list[int]]:
    """Rows (or, for ``out_proj``, columns) of each linear-attention parameter that rank
    ``r`` of ``tp`` holds, from the config's head counts alone (a range, or a list of
    rows in the rank's order): key heads ``r*k .. (r+1)*k``, their value heads."""
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])  # type: ignore[call-overload]
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])  # type: ignore[call-overload]
    k, v = nk // tp, nv // tp
    group_qkvz = 2 * dk + 2 * dv * nv // nk
    qkv = [
        *range(r * k * dk, (r + 1) * k * dk),
        *range(nk * dk + r * k * dk, nk * dk + (r + 1) * k * dk),
        *range(2 * nk * dk + r * v * dv, 2 * nk * dk + (r + 1) * v * dv),
    ]
    return {
        "in_proj_qkvz.weight": (r * k * group_qkvz, (r + 1) * k * group_qkvz),
        "in_proj_ba.weight": (r * 2 * v, (r + 1) * 2 * v),
        "in_proj_qkv.weight": qkv,
        "conv1d.weight": qkv,
        "in_proj_z.weight": (r * v * dv, (r + 1) * v * dv),
        "in_proj_b.weight": (r * v, (r + 1) * v),
        "in_proj_a.weight": (r * v, (r + 1) * v),
        "A_log": (r * v, (r + 1) * v),
        "dt_bias": (r * v, (r + 1) * v),
        "out_proj.weight": (r * v * dv, (r + 1) * v * dv),
    }
