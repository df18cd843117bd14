"""Qwen3-VL (Qwen Team, 2025): the Qwen3 decoder reading images through a ViT tower, with
DeepStack and interleaved multimodal RoPE.

Single-device code: parallelism is applied from outside, from ``plan.py``. The forward pass
is ``components.vision.VisionLanguageTransformer.forward``; the text blocks are Qwen3's
(``dense_blocks``), the tower ``Qwen3VLVisionTower``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..components import dense_blocks
from ..components.vision import MultimodalRotaryEmbedding, VisionLanguageTransformer
from .config import Qwen3VLConfig

if TYPE_CHECKING:
    from ..qwen3_vl_moe.config import Qwen3VLMoeConfig
from .vision import Qwen3VLVisionTower


def multimodal_rope(config: Qwen3VLConfig | Qwen3VLMoeConfig) -> MultimodalRotaryEmbedding:
    """The interleaved M-RoPE of a Qwen3-VL config (dense or MoE)."""
    return MultimodalRotaryEmbedding(
        config.rope, config.head_dim, config.mrope_section, interleaved=config.mrope_interleaved
    )


class Qwen3VL(VisionLanguageTransformer):
    """Qwen3-VL dense: Qwen3 blocks + the Qwen3-VL vision tower."""

    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__(
            config,
            dense_blocks(config, qk_norm=True),
            visual=Qwen3VLVisionTower(config.vision, out_dim=config.dim),
            rope=multimodal_rope(config),
        )
