"""Muse Spark Open: gated GQA with per-layer RoPE / NoPE and sliding windows, residual gates,
a pooled MoE, a soft-capped head; Muse Glimmer's vision tower and an audio tower."""

from ..family import ModelFamily
from .audio import MuseSparkAudioTower
from .config import MUSE_SPARK_FLAVORS, MuseSparkAudioConfig, MuseSparkConfig
from .hf import MuseSparkHFAdapter
from .model import MuseSpark, MuseSparkBlock, router_config
from .plan import plan

FAMILY = ModelFamily(
    name="muse_spark",
    model_cls=MuseSpark,
    config_cls=MuseSparkConfig,
    flavors=MUSE_SPARK_FLAVORS,
    hf_adapter=MuseSparkHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "MUSE_SPARK_FLAVORS",
    "MuseSpark",
    "MuseSparkAudioConfig",
    "MuseSparkAudioTower",
    "MuseSparkBlock",
    "MuseSparkConfig",
    "MuseSparkHFAdapter",
    "plan",
    "router_config",
]
