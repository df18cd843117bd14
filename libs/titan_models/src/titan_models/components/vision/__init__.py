"""Components of vision-language models: patch embedding (2-D and temporal patches), vision
transformer blocks with 2-D rotary positions over images-as-documents attention, learned
position grids resampled to any image size, the patch merger, DeepStack injection,
multimodal RoPE (time / height / width sections, interleaved or chunked) and the
vision-language decoder that ties them to a ``Transformer``."""

from .deepstack import add_at, check_placeholders, placeholder_index, scatter
from .encoder import (
    InterpolatedPositionEmbedding,
    VisionAttention,
    VisionBlock,
    VisionFeedForward,
    vision_attention_metadata,
)
from .language_model import MultimodalKVCache, VisionLanguageTransformer, grid_list
from .merger import PatchMerger
from .patch_embed import PatchEmbed
from .rotary import (
    MultimodalRotaryEmbedding,
    VisionRotaryEmbedding,
    batch_multimodal_positions,
    multimodal_positions,
    patch_coordinates,
)

__all__ = [
    "InterpolatedPositionEmbedding",
    "MultimodalKVCache",
    "MultimodalRotaryEmbedding",
    "PatchEmbed",
    "PatchMerger",
    "VisionAttention",
    "VisionBlock",
    "VisionFeedForward",
    "VisionLanguageTransformer",
    "VisionRotaryEmbedding",
    "add_at",
    "batch_multimodal_positions",
    "check_placeholders",
    "grid_list",
    "multimodal_positions",
    "patch_coordinates",
    "placeholder_index",
    "scatter",
    "vision_attention_metadata",
]
