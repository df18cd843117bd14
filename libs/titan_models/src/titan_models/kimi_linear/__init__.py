"""Kimi Linear models (Kimi Delta Attention + NoPE MLA hybrid, DeepSeek-V3 MoE)."""

from ..family import ModelFamily
from .config import KIMI_LINEAR_FLAVORS, KimiLinearConfig
from .hf import KimiLinearHFAdapter
from .model import KimiLinear, token_mixer
from .plan import plan

FAMILY = ModelFamily(
    name="kimi_linear",
    model_cls=KimiLinear,
    config_cls=KimiLinearConfig,
    flavors=KIMI_LINEAR_FLAVORS,
    hf_adapter=KimiLinearHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "KIMI_LINEAR_FLAVORS",
    "KimiLinear",
    "KimiLinearConfig",
    "KimiLinearHFAdapter",
    "plan",
    "token_mixer",
]
