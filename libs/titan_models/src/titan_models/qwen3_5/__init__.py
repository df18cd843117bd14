"""Qwen3.5 dense models (Gated DeltaNet + gated attention hybrid)."""

from ..family import ModelFamily
from .config import QWEN3_5_FLAVORS, Qwen3_5Config
from .hf import Qwen3_5HFAdapter
from .model import Qwen3_5, hybrid_blocks, token_mixer
from .plan import plan

FAMILY = ModelFamily(
    name="qwen3_5",
    model_cls=Qwen3_5,
    config_cls=Qwen3_5Config,
    flavors=QWEN3_5_FLAVORS,
    hf_adapter=Qwen3_5HFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "QWEN3_5_FLAVORS",
    "Qwen3_5",
    "Qwen3_5Config",
    "Qwen3_5HFAdapter",
    "hybrid_blocks",
    "plan",
    "token_mixer",
]
