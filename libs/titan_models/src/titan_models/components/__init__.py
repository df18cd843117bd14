"""Building blocks shared by every model family."""

from .attention import Attention, attention_inputs, positions_from_document_ids
from .feedforward import FeedForward
from .kv_cache import KVCache, LayerKVCache
from .norm import RMSNorm
from .rope import (
    Llama3RopeScaling,
    RopeConfig,
    RotaryEmbedding,
    YarnRopeScaling,
    apply_rotary,
    rope_frequencies,
)
from .transformer import Transformer, TransformerBlock, TransformerConfig, dense_blocks

__all__ = [
    "Attention",
    "FeedForward",
    "KVCache",
    "LayerKVCache",
    "Llama3RopeScaling",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "YarnRopeScaling",
    "apply_rotary",
    "attention_inputs",
    "dense_blocks",
    "positions_from_document_ids",
    "rope_frequencies",
]
