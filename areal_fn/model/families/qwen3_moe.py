"""Qwen3-MoE: Qwen3 attention plus routed experts (no shared expert).

Layer ``i`` is MoE when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step
== 0``; other layers have a dense MLP of ``intermediate_size``. An MoE layer has a router
``mlp.gate.weight`` ``[num_experts, hidden]`` and, per expert ``e``,
``mlp.experts.{e}.{gate,up,down}_proj.weight`` of ``moe_intermediate_size``.

Checkpoints (and ``save_pretrained`` in transformers 5) store experts one tensor per
expert; transformers 5 fuses them in memory into ``mlp.experts.gate_up_proj``
``[E, 2*I, H]`` (expert ``e`` = ``[gate_e; up_e]``) and ``mlp.experts.down_proj``
``[E, H, I]``. ``num_local_experts`` is accepted as another name of ``num_experts``
(transformers 5 writes it under that name).
"""

from areal_fn.model.families import SOFTMAX_ROUTING, STACKED_SWIGLU_EXPERTS, Family
from areal_fn.model.families.mapping import (
    GQA_ATTENTION,
    GQA_ATTENTION_HF,
    LAYER_NORMS_HF,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_HF,
    SWIGLU_MLP,
    SWIGLU_MLP_HF,
)
from areal_fn.model.families.serving import Serving, TiedRefusal

FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    canonical=(*GQA_ATTENTION_HF, *SWIGLU_MLP_HF, *ROUTED_EXPERTS_HF, *LAYER_NORMS_HF),
    megatron=(*GQA_ATTENTION, *SWIGLU_MLP, *ROUTED_EXPERTS),
    required=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    ),
    defaults=(
        ("head_dim", None),  # None -> hidden_size // num_attention_heads
        ("tie_word_embeddings", False),
        ("attention_bias", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 32768),
        ("use_sliding_window", False),
        ("sliding_window", 4096),  # used only when use_sliding_window is true
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
        ("norm_topk_prob", False),
    ),
    bias_flags=(("attention_bias", ("qkv_bias", "o_bias")),),
    fixed=(
        ("mlp_bias", False),
        ("qk_norm", True),
        *SOFTMAX_ROUTING,
    ),
    moe=True,
    sliding_window="all_layers",
    fused_experts=STACKED_SWIGLU_EXPERTS,
    serving=Serving(
        vllm_layout=True,
        tied_refusals=(
            TiedRefusal(
                engine="sglang",
                pp_only=False,
                reason="SGLang's Qwen3MoeForCausalLM cannot serve a model with "
                "tie_word_embeddings: it builds its own lm_head and never loads the tied "
                "embedding into it (sglang/srt/models/qwen3_moe.py); use vllm or an untied "
                "model",
            ),
        ),
    ),
)
