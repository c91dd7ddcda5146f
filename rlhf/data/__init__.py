"""Data contract, packing and datasets."""

from rlhf.data.packing import concat, pack, plan_bins, unpack
from rlhf.data.types import TOKEN_FIELDS, FlatBatch, Sample, validate_sample

__all__ = ["TOKEN_FIELDS", "FlatBatch", "Sample", "concat", "pack", "plan_bins", "unpack", "validate_sample"]
