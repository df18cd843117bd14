"""DeepSeek-V4 models (V4-Flash, V4-Pro)."""

from ..family import ModelFamily
from .attention import DeepSeekV4Attention
from .config import DEEPSEEK_V4_FLAVORS, DeepSeekV4Config
from .hf import DeepSeekV4HFAdapter
from .model import DeepSeekV4, DeepSeekV4Block, HyperHeadNorm, router_config
from .plan import plan

FAMILY = ModelFamily(
    name="deepseek_v4",
    model_cls=DeepSeekV4,
    config_cls=DeepSeekV4Config,
    flavors=DEEPSEEK_V4_FLAVORS,
    hf_adapter=DeepSeekV4HFAdapter(),
    plan=plan,
)

__all__ = [
    "DEEPSEEK_V4_FLAVORS",
    "FAMILY",
    "DeepSeekV4",
    "DeepSeekV4Attention",
    "DeepSeekV4Block",
    "DeepSeekV4Config",
    "DeepSeekV4HFAdapter",
    "HyperHeadNorm",
    "plan",
    "router_config",
]
