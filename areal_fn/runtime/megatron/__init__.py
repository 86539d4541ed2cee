"""Megatron-Core: building GPTModels and parallel state, and the CPU redirections (in one module)."""
