"""Layouts: every rank's local tensors as pieces of canonical tensors (FSDP2, Megatron-Core, inference engines)."""
