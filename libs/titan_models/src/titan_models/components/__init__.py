"""Building blocks shared by every model family."""

from .attention import Attention, attention_inputs, positions_from_document_ids
from .feedforward import FeedForward
from .kv_cache import KVCache, LayerKVCache, LayerRecurrentState
from .mla import MultiHeadLatentAttention
from .moe import MoEFeedForward
from .norm import GatedRMSNorm, RMSNorm
from .rope import (
    Llama3RopeScaling,
    RopeConfig,
    RotaryEmbedding,
    YarnRopeScaling,
    apply_rotary,
    rope_frequencies,
)
from .transformer import (
    Transformer,
    TransformerBlock,
    TransformerConfig,
    dense_blocks,
    gqa_attention,
)

__all__ = [
    "Attention",
    "FeedForward",
    "GatedRMSNorm",
    "KVCache",
    "LayerKVCache",
    "LayerRecurrentState",
    "Llama3RopeScaling",
    "MoEFeedForward",
    "MultiHeadLatentAttention",
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
    "gqa_attention",
    "positions_from_document_ids",
    "rope_frequencies",
]
