"""Qwen3 dense models."""

from ..family import ModelFamily
from .config import QWEN3_FLAVORS, Qwen3Config
from .hf import Qwen3HFAdapter
from .model import Qwen3
from .plan import plan

FAMILY = ModelFamily(
    name="qwen3",
    model_cls=Qwen3,
    config_cls=Qwen3Config,
    flavors=QWEN3_FLAVORS,
    hf_adapter=Qwen3HFAdapter(),
    plan=plan,
)

__all__ = ["FAMILY", "QWEN3_FLAVORS", "Qwen3", "Qwen3Config", "Qwen3HFAdapter", "plan"]
