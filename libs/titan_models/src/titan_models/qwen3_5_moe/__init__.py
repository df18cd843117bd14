"""Qwen3.5-MoE models (Gated DeltaNet + gated attention hybrid, routed + shared experts)."""

from ..family import ModelFamily
from .config import QWEN3_5_MOE_FLAVORS, Qwen3_5MoeConfig
from .hf import Qwen3_5MoeHFAdapter
from .model import Qwen3_5Moe, router_config
from .plan import plan

FAMILY = ModelFamily(
    name="qwen3_5_moe",
    model_cls=Qwen3_5Moe,
    config_cls=Qwen3_5MoeConfig,
    flavors=QWEN3_5_MOE_FLAVORS,
    hf_adapter=Qwen3_5MoeHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "QWEN3_5_MOE_FLAVORS",
    "Qwen3_5Moe",
    "Qwen3_5MoeConfig",
    "Qwen3_5MoeHFAdapter",
    "plan",
    "router_config",
]
