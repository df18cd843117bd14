"""Llama 3 / 3.1 / 3.2 dense models."""

from ..family import ModelFamily
from .config import LLAMA3_FLAVORS, Llama3Config
from .hf import Llama3HFAdapter
from .model import Llama3
from .plan import plan

FAMILY = ModelFamily(
    name="llama3",
    model_cls=Llama3,
    config_cls=Llama3Config,
    flavors=LLAMA3_FLAVORS,
    hf_adapter=Llama3HFAdapter(),
    plan=plan,
)

__all__ = ["FAMILY", "LLAMA3_FLAVORS", "Llama3", "Llama3Config", "Llama3HFAdapter", "plan"]
