"""gpt-oss models (20B, 120B)."""

from ..family import ModelFamily
from .config import GPT_OSS_FLAVORS, GptOssConfig
from .hf import GptOssHFAdapter
from .model import GptOss, expert_activation, router_config
from .plan import plan

FAMILY = ModelFamily(
    name="gpt_oss",
    model_cls=GptOss,
    config_cls=GptOssConfig,
    flavors=GPT_OSS_FLAVORS,
    hf_adapter=GptOssHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "GPT_OSS_FLAVORS",
    "GptOss",
    "GptOssConfig",
    "GptOssHFAdapter",
    "expert_activation",
    "plan",
    "router_config",
]
