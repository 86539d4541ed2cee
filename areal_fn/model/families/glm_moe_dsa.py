"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's layers (:mod:`.deepseek_v32`) with GLM's
sizes, one routing group, and the indexer shared across layers: the config's
``indexer_types`` (or ``index_topk_pattern``, or ``index_topk_freq`` with
``index_skip_topk_offset``, as transformers derives them) mark each layer ``"full"``
(it runs an indexer of its own) or ``"shared"`` (it attends to the top-k of the last
full layer before it and holds no ``self_attn.indexer.*`` tensors). Its indexer rotates
interleaved rope dims. Published GLM-5 runs an indexer in every layer.
"""

from areal_fn.model.families import STACKED_SWIGLU_EXPERTS, Family
from areal_fn.model.families.deepseek_v32 import (
    DSA_ATTENTION_HF,
    DSA_MEGATRON_REFUSAL,
    DSA_REQUIRED,
    DSA_SEQUENCE_REFUSAL,
)
from areal_fn.model.families.deepseek_v32 import FAMILY as DEEPSEEK_V32
from areal_fn.model.families.glm4_moe import (
    DEEPSEEK_MOE_FOREIGN_KEYS,
    DEEPSEEK_MOE_KEYS,
    DEEPSEEK_MOE_LAYER_HF,
)
from areal_fn.model.families.serving import MtpBlock

_GLM_DEFAULTS = {
    "num_key_value_heads": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "q_lora_rank": 2048,
    "n_group": 1,
    "topk_group": 1,
    "index_n_heads": 32,
}

FAMILY = Family(
    model_type="glm_moe_dsa",
    architecture="GlmMoeDsaForCausalLM",
    canonical=(*DSA_ATTENTION_HF, *DEEPSEEK_MOE_LAYER_HF),
    megatron=(),
    required=DSA_REQUIRED,
    defaults=tuple((k, _GLM_DEFAULTS.get(k, v)) for k, v in DEEPSEEK_V32.defaults),
    bias_flags=(),
    fixed=DEEPSEEK_V32.fixed,
    must_be=DEEPSEEK_V32.must_be,
    moe=True,
    mla=True,
    indexer="indexer_types",
    first_k_dense="first_k_dense_replace",
    mtp=MtpBlock(),
    key_sources=(("num_experts", "n_routed_experts"),),
    foreign_keys=DEEPSEEK_MOE_FOREIGN_KEYS,
    moe_keys=DEEPSEEK_MOE_KEYS,
    fused_experts=STACKED_SWIGLU_EXPERTS,
    megatron_refusal=DSA_MEGATRON_REFUSAL.format(mt="glm_moe_dsa"),
    sequence_refusal=DSA_SEQUENCE_REFUSAL.format(mt="glm_moe_dsa"),
)
