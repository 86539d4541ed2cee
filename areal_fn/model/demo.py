"""The tiny model of the main job (``areal-fn demo``), usable wherever a config is.

Two heads of 32 dimensions: vLLM's CPU attention needs a head dimension of at least 32,
and the demo syncs into a real vLLM at TP2.
"""

#: The tiny Qwen2-architecture model the demo trains (random weights, no download).
DEMO_CONFIG: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
