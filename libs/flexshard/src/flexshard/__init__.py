"""Bucket-based data-parallel sharding (Shard/Replicate/Owned/BlockShard), distributed Muon, block-FP8 all-gather."""

__version__ = "0.1.0"

__all__ = ["__version__"]
