"""Qwen3 dense parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, dense_decoder_plan
from .config import Qwen3Config
from .model import Qwen3


def plan(config: Qwen3Config) -> ModelPlan:
    """As Llama 3, plus the per-head QK-norms: replicated, on the local heads."""
    return dense_decoder_plan(Qwen3, config, qk_norm=True)
