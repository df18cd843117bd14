"""Bucket-based data-parallel sharding (Shard/Replicate/Owned/BlockShard), distributed Muon, block-FP8 all-gather."""

from flexshard import optim
from flexshard._layout import CommStats
from flexshard._runtime import FlexShardModule, MemStats, ParamInfo, param_info
from flexshard.api import default_buckets, shard
from flexshard.clip import clip_grad_norm_, global_grad_norm
from flexshard.fp8 import dequantize_tiles, fp8_block_error_bound, quantize_tiles
from flexshard.fqn import fqn_matches
from flexshard.optim_state import (
    init_optim_state,
    load_sharded_optim_state_dict,
    sharded_optim_state_dict,
)
from flexshard.placements import (
    BlockShard,
    Bucket,
    MixedPrecision,
    Owned,
    Placement,
    Replicate,
    Shard,
)
from flexshard.state_dict import (
    ShardedParam,
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)

__version__ = "0.1.0"


def comm_stats(module) -> CommStats:
    """Bytes this rank sent per collective kind since ``shard`` (or ``reset()``)."""
    return module.flexshard_state.comm


def memory_stats(module) -> MemStats:
    """Measured bytes of parameter storage held by this rank (``current``, ``peak``)."""
    return module.flexshard_state.mem


__all__ = [
    "BlockShard",
    "Bucket",
    "CommStats",
    "FlexShardModule",
    "MemStats",
    "MixedPrecision",
    "Owned",
    "ParamInfo",
    "Placement",
    "Replicate",
    "Shard",
    "ShardedParam",
    "__version__",
    "clip_grad_norm_",
    "comm_stats",
    "default_buckets",
    "dequantize_tiles",
    "fp8_block_error_bound",
    "fqn_matches",
    "full_state_dict",
    "global_grad_norm",
    "init_optim_state",
    "load_full_state_dict",
    "load_sharded_optim_state_dict",
    "load_sharded_state_dict",
    "memory_stats",
    "optim",
    "param_info",
    "quantize_tiles",
    "shard",
    "sharded_optim_state_dict",
    "sharded_state_dict",
]
