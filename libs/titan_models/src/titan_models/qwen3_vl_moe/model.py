"""Qwen3-VL-MoE (Qwen Team, 2025): the Qwen3-MoE decoder reading images through the Qwen3-VL
vision tower, with DeepStack and interleaved multimodal RoPE.

Single-device code: parallelism (experts included) is applied from outside, from
``plan.py``. The forward pass is ``components.vision.VisionLanguageTransformer.forward``.
"""

from __future__ import annotations

from ..components.vision import VisionLanguageTransformer
from ..qwen3_moe.model import qwen3_moe_blocks
from ..qwen3_vl.model import multimodal_rope
from ..qwen3_vl.vision import Qwen3VLVisionTower
from .config import Qwen3VLMoeConfig


class Qwen3VLMoe(VisionLanguageTransformer):
    """Qwen3-VL-MoE: Qwen3-MoE blocks (routed SwiGLU experts) + the Qwen3-VL vision tower."""

    def __init__(self, config: Qwen3VLMoeConfig) -> None:
        super().__init__(
            config,
            qwen3_moe_blocks(config),
            visual=Qwen3VLVisionTower(config.vision, out_dim=config.dim),
            rope=multimodal_rope(config),
        )
