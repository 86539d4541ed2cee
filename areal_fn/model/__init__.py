"""Model specs: canonical tensors from an HF config, one declarative module per family, the HF in-memory view."""
