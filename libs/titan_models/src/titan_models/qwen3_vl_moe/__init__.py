"""Qwen3-VL-MoE vision-language models (30B-A3B, 235B-A22B)."""

from ..family import ModelFamily
from .config import QWEN3_VL_MOE_FLAVORS, Qwen3VLMoeConfig
from .hf import Qwen3VLMoeHFAdapter
from .model import Qwen3VLMoe
from .plan import plan

FAMILY = ModelFamily(
    name="qwen3_vl_moe",
    model_cls=Qwen3VLMoe,
    config_cls=Qwen3VLMoeConfig,
    flavors=QWEN3_VL_MOE_FLAVORS,
    hf_adapter=Qwen3VLMoeHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "QWEN3_VL_MOE_FLAVORS",
    "Qwen3VLMoe",
    "Qwen3VLMoeConfig",
    "Qwen3VLMoeHFAdapter",
    "plan",
]
