"""Llama 3 parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, dense_decoder_plan
from .config import Llama3Config
from .model import Llama3


def plan(config: Llama3Config) -> ModelPlan:
    """Megatron-style TP/SP layout, one pipeline unit per block, blocks as remat units."""
    return dense_decoder_plan(Llama3, config, qk_norm=False)
