"""The name vLLM knows the areal_fn weight-transfer backend by (no vLLM import)."""

AREAL_FN_BACKEND = "areal_fn"
