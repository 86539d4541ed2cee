"""The names PEFT's ``LoraConfig`` targets in the families' decoder layers: the modules
(``target_modules``) and routed experts' fused parameters (``target_parameters``) that
:class:`~areal_fn.model.lora.LoraConfig` accepts, as the families' tables name them."""

#: Attention projections: grouped-query attention's and multi-latent attention's.
ATTENTION_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
#: A SwiGLU MLP's projections.
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
#: The fused routed-expert parameters, in the order transformers registers them.
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
