"""Qwen3-VL dense vision-language models (2B-32B)."""

from ..family import ModelFamily
from .config import QWEN3_VL_FLAVORS, Qwen3VLConfig, Qwen3VLVisionConfig
from .hf import Qwen3VLHFAdapter
from .model import Qwen3VL
from .plan import plan
from .vision import Qwen3VLVisionTower

FAMILY = ModelFamily(
    name="qwen3_vl",
    model_cls=Qwen3VL,
    config_cls=Qwen3VLConfig,
    flavors=QWEN3_VL_FLAVORS,
    hf_adapter=Qwen3VLHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "QWEN3_VL_FLAVORS",
    "Qwen3VL",
    "Qwen3VLConfig",
    "Qwen3VLHFAdapter",
    "Qwen3VLVisionConfig",
    "Qwen3VLVisionTower",
    "plan",
]
