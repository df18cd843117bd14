"""Building blocks shared by every model family."""

from .attention import Attention, attention_inputs, positions_from_document_ids
from .feedforward import FeedForward
from .init import Constant, Init, Normal, init_state, local_chunks
from .kv_cache import KVCache, LayerKVCache
from .mla import MultiHeadLatentAttention
from .moe import MoEFeedForward
from .norm import RMSNorm
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
    "Constant",
    "FeedForward",
    "Init",
    "KVCache",
    "LayerKVCache",
    "Llama3RopeScaling",
    "MoEFeedForward",
    "MultiHeadLatentAttention",
    "Normal",
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
    "init_state",
    "local_chunks",
    "positions_from_document_ids",
    "rope_frequencies",
]
