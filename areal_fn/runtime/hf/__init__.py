"""HF checkpoints on disk: sliced safetensors reads, atomic writes, carried files, conversion to and from rank files."""
