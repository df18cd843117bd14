"""Qwen3-VL-MoE parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, decoder_plan
from ..qwen3_vl.plan import with_vision_tower
from .config import Qwen3VLMoeConfig
from .model import Qwen3VLMoe


def plan(config: Qwen3VLMoeConfig) -> ModelPlan:
    """Qwen3-MoE's plan (attention TP by heads, every MoE expert-parallel) plus the tower
    (``qwen3_vl.plan.with_vision_tower``)."""
    text = decoder_plan(
        Qwen3VLMoe,
        config,
        colwise=("layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv"),
        rowwise=("layers.*.attention.wo",),
        replicated=("layers.*.attention.q_norm", "layers.*.attention.k_norm"),
        experts=("layers.*.feed_forward",),
    )
    return with_vision_tower(text, Qwen3VLMoe, config)
