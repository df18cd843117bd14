"""DeepSeek-V3 models (MLA, MoE with shared experts, multi-token prediction)."""

from ..family import ModelFamily
from .config import DEEPSEEK_V3_FLAVORS, DeepSeekV3Config
from .hf import DeepSeekV3HFAdapter
from .model import DeepSeekV3, MTPModule, router_config, softmax_scale
from .plan import plan

FAMILY = ModelFamily(
    name="deepseek_v3",
    model_cls=DeepSeekV3,
    config_cls=DeepSeekV3Config,
    flavors=DEEPSEEK_V3_FLAVORS,
    hf_adapter=DeepSeekV3HFAdapter(),
    plan=plan,
)

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "FAMILY",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekV3HFAdapter",
    "MTPModule",
    "plan",
    "router_config",
    "softmax_scale",
]
