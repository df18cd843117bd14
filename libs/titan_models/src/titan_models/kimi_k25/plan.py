"""Kimi K2.5 parallelism plan (pure data): DeepSeek-V3's, plus the MoonViT tower."""

from __future__ import annotations

from ..deepseek_v3.plan import plan as deepseek_v3_plan
from ..plan import ModelPlan
from ..qwen3_vl.plan import with_vision_tower
from .config import KimiK25Config
from .model import KimiK25


def plan(config: KimiK25Config) -> ModelPlan:
    """The decoder as DeepSeek-V3 (MLA by heads, experts expert-parallel, CP on text) and the
    tower as Qwen3-VL's (``with_vision_tower``): replicated over tensor parallel unless
    ``vision.tensor_parallel``, in the first pipeline unit with the embedding, each vision
    block a remat unit."""
    return with_vision_tower(deepseek_v3_plan(config, KimiK25), KimiK25, config)
