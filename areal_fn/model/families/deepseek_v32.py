"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 (:mod:`.deepseek_v3`) with DeepSeek
sparse attention: every attention layer also holds a lightning indexer
(:mod:`areal_fn.model.dsa`) that keeps the ``index_topk`` best-scored keys of each query.

An attention layer holds multi-latent attention's tensors (a query LoRA is required:
the indexer reads its latent), then ``self_attn.indexer.wq_b``
``[index_n_heads * index_head_dim, q_lora_rank]``, ``indexer.wk`` ``[index_head_dim, H]``,
``indexer.k_norm`` (a LayerNorm: ``weight`` and ``bias`` ``[index_head_dim]``) and
``indexer.weights_proj`` ``[index_n_heads, H]``. The MLP is DeepSeek-V3's
(``first_k_dense_replace`` dense layers, then sigmoid-routed experts with shared
experts). transformers' attention always rotates interleaved rope dims (its config has
no ``rope_interleave``; ``false`` is refused), the indexer the first
``qk_rope_head_dim`` of its dims in halves; the indexer runs without gradient.
"""

from areal_fn.model.families import CORE_KEYS, STACKED_SWIGLU_EXPERTS, Family
from areal_fn.model.families.deepseek_v3 import MLA_ATTENTION_HF
from areal_fn.model.families.glm4_moe import (
    DEEPSEEK_MOE_FOREIGN_KEYS,
    DEEPSEEK_MOE_KEYS,
    DEEPSEEK_MOE_LAYER_HF,
)
from areal_fn.model.families.mapping import Dim, HfTensor
from areal_fn.model.families.serving import MtpBlock


def _indexer(name: str, *shape: Dim) -> HfTensor:
    return HfTensor(name=f"self_attn.indexer.{name}", shape=shape, when="index_n_heads")


#: The lightning indexer of a DSA layer, in transformers' registration order (absent on
#: a layer that reuses another layer's top-k: ``index_n_heads`` is 0 there).
DSA_INDEXER_HF: tuple[HfTensor, ...] = (
    _indexer("wq_b.weight", Dim.INDEX_Q_OUT, Dim.Q_LORA),
    _indexer("wk.weight", Dim.INDEX_HEAD_DIM, Dim.HIDDEN),
    _indexer("k_norm.weight", Dim.INDEX_HEAD_DIM),
    _indexer("k_norm.bias", Dim.INDEX_HEAD_DIM),
    _indexer("weights_proj.weight", Dim.INDEX_HEADS, Dim.HIDDEN),
)

#: Multi-latent attention with a query LoRA, then the indexer.
DSA_ATTENTION_HF: tuple[HfTensor, ...] = (
    *(r for r in MLA_ATTENTION_HF if r.when != "q_direct"),
    *DSA_INDEXER_HF,
)

#: Why Megatron-Core 0.16 cannot hold these families' layers here.
DSA_MEGATRON_REFUSAL = (
    "Megatron-Core 0.16's DSAIndexer rotates its queries and keys with "
    "fast_hadamard_transform, a CUDA extension for bf16 that is not installed here "
    "('fast_hadamard_transform is not installed.'), so {mt}'s sparse attention cannot "
    "run on this path; use the fsdp backend"
)

#: Why the engines cannot split or pack these families' sequences.
DSA_SEQUENCE_REFUSAL = (
    "{mt}'s indexer (transformers) scores every key of the row inside its attention module, "
    "outside the attention function the engines replace for Ulysses and packing, so it "
    "would pick its top-k from one rank's shard of the sequence or across packed sequences"
)

#: The config keys and defaults DeepSeek-V3.2 and GLM-5 share (transformers' classes).
DSA_REQUIRED = (
    *CORE_KEYS,
    "moe_intermediate_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)

FAMILY = Family(
    model_type="deepseek_v32",
    architecture="DeepseekV32ForCausalLM",
    canonical=(*DSA_ATTENTION_HF, *DEEPSEEK_MOE_LAYER_HF),
    megatron=(),
    required=DSA_REQUIRED,
    defaults=(
        # transformers' class default, which multi-latent attention needs equal to the
        # heads (its num_key_value_groups divides them): a config without it is refused
        ("num_key_value_heads", 128),
        ("tie_word_embeddings", False),
        ("rms_norm_eps", 1e-6),
        ("rope_theta", 10000.0),
        ("max_position_embeddings", 163840),
        ("q_lora_rank", 1536),
        ("rope_interleave", True),
        ("n_routed_experts", 256),
        ("num_experts_per_tok", 8),
        ("n_shared_experts", 1),
        ("routed_scaling_factor", 2.5),
        ("n_group", 8),
        ("topk_group", 4),
        ("first_k_dense_replace", 3),
        ("num_nextn_predict_layers", 1),
        ("norm_topk_prob", True),
        ("index_n_heads", 64),
        ("index_head_dim", 128),
        ("index_topk", 2048),
    ),
    bias_flags=(),
    fixed=(
        ("qkv_bias", False),
        ("o_bias", False),
        ("mlp_bias", False),
        ("qk_norm", False),
        ("router_score", "sigmoid"),
        ("router_bias", True),
        ("rope_interleave", True),
    ),
    must_be=(("attention_bias", False), ("rope_interleave", True)),
    moe=True,
    mla=True,
    indexer="every_layer",
    first_k_dense="first_k_dense_replace",
    mtp=MtpBlock(),
    key_sources=(("num_experts", "n_routed_experts"),),
    foreign_keys=DEEPSEEK_MOE_FOREIGN_KEYS,
    moe_keys=DEEPSEEK_MOE_KEYS,
    fused_experts=STACKED_SWIGLU_EXPERTS,
    megatron_refusal=DSA_MEGATRON_REFUSAL.format(mt="deepseek_v32"),
    sequence_refusal=DSA_SEQUENCE_REFUSAL.format(mt="deepseek_v32"),
)
