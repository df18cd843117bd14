"""Qwen3-MoE models (30B-A3B, 235B-A22B)."""

from ..family import ModelFamily
from .config import QWEN3_MOE_FLAVORS, Qwen3MoeConfig
from .hf import Qwen3MoeHFAdapter
from .model import Qwen3Moe, router_config
from .plan import plan

FAMILY = ModelFamily(
    name="qwen3_moe",
    model_cls=Qwen3Moe,
    config_cls=Qwen3MoeConfig,
    flavors=QWEN3_MOE_FLAVORS,
    hf_adapter=Qwen3MoeHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "QWEN3_MOE_FLAVORS",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "Qwen3MoeHFAdapter",
    "plan",
    "router_config",
]
