"""MiniMax-M2 (``minimax_m2``): GQA with q/k norms over the whole projection and partial
rotary, every layer a sparse MoE block behind a sigmoid router with a score-correction
bias.

A layer holds ``self_attn.{q,k,v,o}_proj`` (no biases), ``self_attn.q_norm``
``[heads*head_dim]`` and ``self_attn.k_norm`` ``[kv_heads*head_dim]`` (RMSNorm over the
whole q and k projections, before they are split into heads: transformers builds them
whatever ``use_qk_norm`` says), the two pre-norms, and under ``block_sparse_moe`` the
router ``gate.weight`` ``[E, H]``, its buffer ``e_score_correction_bias`` ``[E]`` and per
expert ``e`` the SwiGLU weights ``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down),
``intermediate_size`` wide. transformers 5 keeps the router as ``mlp.gate.weight``, the
buffer as ``mlp.e_score_correction_bias`` and fuses the experts as Mixtral's. The router
ranks ``sigmoid(logits) + bias`` and renormalises the chosen sigmoid scores (no groups,
no scaling, no shared experts). ``rotary_dim`` dims of each head rotate
(``partial_rotary_factor = rotary_dim / head_dim``).

The published config's multi-token-prediction modules (``use_mtp``,
``num_mtp_modules``) are not part of the model transformers builds or
``save_pretrained`` writes, so they are not canonical tensors here.

Megatron-Core 0.16's ``GPTModel`` cannot express it: its ``q_layernorm`` normalises each
head, not the whole projection. The FSDP2 engine runs it without tensor parallelism, for
the same reason as OLMo 3.
"""

from areal_fn.model.families import Family
from areal_fn.model.families.mapping import LAYER_NORMS_HF, Dim, HfTensor, LayerKind
from areal_fn.model.families.mixtral import SPARSE_MOE_FUSED, SPARSE_MOE_HF
from areal_fn.model.families.olmo3 import FULL_QK_NORM_ATTENTION_HF

_BIAS = HfTensor(
    name="block_sparse_moe.e_score_correction_bias",
    shape=(Dim.EXPERTS,),
    when="router_bias",
    layers=LayerKind.MOE,
    buffer=True,
)

FAMILY = Family(
    model_type="minimax_m2",
    architecture="MiniMaxM2ForCausalLM",
    canonical=(
        *FULL_QK_NORM_ATTENTION_HF,
        _BIAS,
        *SPARSE_MOE_HF,
        *LAYER_NORMS_HF,
    ),
    megatron=(),
    required=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    ),
    defaults=(
        ("num_key_value_heads", 8),
        ("head_dim", 128),
        ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 5000000.0),
        ("partial_rotary_factor", 1.0),
        ("max_position_embeddings", 196608),
        ("num_experts", 256),
        ("num_experts_per_tok", 8),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
    ),
    bias_flags=(),
    fixed=(
        ("qkv_bias", False),
        ("o_bias", False),
        ("mlp_bias", False),
        ("qk_norm", True),
        ("norm_topk_prob", True),
        ("num_shared_experts", 0),
        ("router_score", "sigmoid"),
        ("router_bias", True),
        ("router_groups", 1),
        ("router_group_topk", 1),
        ("routed_scaling_factor", 1.0),
    ),
    moe=True,
    partial_rotary=True,
    rotary_dim_key="rotary_dim",
    key_sources=(("moe_intermediate_size", "intermediate_size"),),
    must_be=(
        ("router_jitter_noise", 0.0),
        ("use_qk_norm", True),
        ("qk_norm_type", "per_layer"),
        ("scoring_func", "sigmoid"),
        ("use_routing_bias", True),
        ("shared_intermediate_size", 0),
    ),
    foreign_keys=(
        ("num_experts", "num_local_experts"),
        ("moe_intermediate_size", "intermediate_size (the experts' width)"),
        ("decoder_sparse_step", "nothing: every MiniMax-M2 layer is sparse"),
        ("mlp_only_layers", "nothing: every MiniMax-M2 layer is sparse"),
        ("norm_topk_prob", "nothing: MiniMax-M2 always renormalises the top-k"),
    ),
    memory_names=(
        ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
        ("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"),
    ),
    fused_experts=SPARSE_MOE_FUSED,
    megatron_refusal=(
        "Megatron-Core 0.16's GPTModel cannot express minimax_m2: its q_layernorm "
        "normalises each head, not the whole q/k projection; use the fsdp backend"
    ),
    fsdp2_tp_refusal=(
        "minimax_m2's q_norm/k_norm normalise the whole q and k projections, which "
        "column-wise TP splits by heads (the FSDP2 engine would norm each rank's heads alone)"
    ),
)
