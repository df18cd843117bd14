"""Qwen3-MoE parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, decoder_plan
from .config import Qwen3MoeConfig
from .model import Qwen3Moe


def plan(config: Qwen3MoeConfig) -> ModelPlan:
    """Attention as Qwen3 dense (TP by heads, QK-norms replicated); every block's MoE is an
    expert-parallel unit (``ModelPlan.experts``), not tensor-parallel."""
    return decoder_plan(
        Qwen3Moe,
        config,
        colwise=("layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv"),
        rowwise=("layers.*.attention.wo",),
        replicated=("layers.*.attention.q_norm", "layers.*.attention.k_norm"),
        experts=("layers.*.feed_forward",),
    )
