"""Qwen3.5-MoE parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, decoder_plan
from ..qwen3_5.plan import mixer_tp
from .config import Qwen3_5MoeConfig
from .model import Qwen3_5Moe


def plan(config: Qwen3_5MoeConfig) -> ModelPlan:
    """Token mixers as Qwen3.5; every block's MoE (router, routed and shared experts) is an
    expert-parallel unit (``ModelPlan.experts``), not tensor-parallel."""
    return decoder_plan(
        Qwen3_5Moe, config, **mixer_tp(config, moe=True), experts=("layers.*.feed_forward",)
    )
