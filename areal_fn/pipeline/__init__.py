"""Pipeline partitions: the exact min-max partition, VPP balancing, cost models, Megatron layout strings."""
