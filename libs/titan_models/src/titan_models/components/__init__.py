"""Building blocks shared by every model family."""

from .attention import Attention, AttentionSinks, build_attention_metadata, cached_keys
from .attention_metadata import AttentionMetadata, CacheStep, positions_from_document_ids
from .backends import (
    AttentionBackend,
    attend,
    attention_backends,
    prepare_attention,
    register_attention_backend,
    resolve_attention_backend,
)
from .context_parallel import ContextParallel, zigzag_shard, zigzag_unshard
from .dense_attention import math_attention, sdpa
from .feedforward import FeedForward
from .init import Constant, HashRoutes, Init, Normal, init_state, local_chunks
from .kv_cache import KVCache, LayerKVCache, LayerRecurrentState
from .lora import (
    LoRAGroupedExperts,
    LoRALinear,
    apply_lora,
    is_lora_param,
    lora_delta,
    lora_weights,
    merge_lora,
)
from .mla import MultiHeadLatentAttention
from .moe import MoEFeedForward
from .norm import GatedRMSNorm, InputScaledRMSNorm, RMSNorm, unit_rms
from .output_head import SoftCappedLinear
from .quantize import Float8GroupedExperts, Float8Linear, quantize_modules
from .rope import (
    Llama3RopeScaling,
    RopeConfig,
    RotaryEmbedding,
    YarnRopeScaling,
    apply_rotary,
    rope_frequencies,
)
from .scaled_mm import Float8Recipe, scaled_grouped_linear, scaled_linear
from .transformer import (
    Transformer,
    TransformerBlock,
    TransformerConfig,
    dense_blocks,
    gqa_attention,
)

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSinks",
    "CacheStep",
    "Constant",
    "ContextParallel",
    "FeedForward",
    "Float8GroupedExperts",
    "Float8Linear",
    "Float8Recipe",
    "GatedRMSNorm",
    "HashRoutes",
    "Init",
    "InputScaledRMSNorm",
    "KVCache",
    "LayerKVCache",
    "LayerRecurrentState",
    "Llama3RopeScaling",
    "LoRAGroupedExperts",
    "LoRALinear",
    "MoEFeedForward",
    "MultiHeadLatentAttention",
    "Normal",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "SoftCappedLinear",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "YarnRopeScaling",
    "apply_lora",
    "apply_rotary",
    "attend",
    "attention_backends",
    "build_attention_metadata",
    "cached_keys",
    "dense_blocks",
    "gqa_attention",
    "init_state",
    "is_lora_param",
    "local_chunks",
    "lora_delta",
    "lora_weights",
    "math_attention",
    "merge_lora",
    "positions_from_document_ids",
    "prepare_attention",
    "quantize_modules",
    "register_attention_backend",
    "resolve_attention_backend",
    "rope_frequencies",
    "scaled_grouped_linear",
    "scaled_linear",
    "sdpa",
    "unit_rms",
    "zigzag_shard",
    "zigzag_unshard",
]
