"""Kimi K2.5 / K2.6 / K2.7: the DeepSeek-V3 decoder with the MoonViT vision tower."""

from ..family import ModelFamily
from .config import KIMI_K25_FLAVORS, KimiK25Config, KimiK25VisionConfig
from .hf import KimiK25HFAdapter
from .model import KimiK25
from .plan import plan
from .vision import KimiK25VisionTower

FAMILY = ModelFamily(
    name="kimi_k25",
    model_cls=KimiK25,
    config_cls=KimiK25Config,
    flavors=KIMI_K25_FLAVORS,
    hf_adapter=KimiK25HFAdapter(),
    plan=plan,  # pyrefly: ignore[bad-argument-type]  # a DeepSeek-V3 subclass: Kimi configs only
)

__all__ = [
    "FAMILY",
    "KIMI_K25_FLAVORS",
    "KimiK25",
    "KimiK25Config",
    "KimiK25HFAdapter",
    "KimiK25VisionConfig",
    "KimiK25VisionTower",
    "plan",
]
