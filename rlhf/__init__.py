"""rlhf: Ray-distributed RLHF with padding-free packing."""
