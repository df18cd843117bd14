"""What the registry knows about one model family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .components import Transformer, TransformerConfig
from .hf_adapter import HFAdapter
from .plan import ModelPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """A family's model class, config class, named flavours, HF adapter and plan."""

    name: str
    """Registry name, e.g. ``llama3``."""
    model_cls: type[Transformer]
    """Built as ``model_cls(config)``."""
    config_cls: type[TransformerConfig]
    """The family's config dataclass."""
    flavors: Mapping[str, TransformerConfig]
    """Named configs, smallest first, ``debug`` among them."""
    hf_adapter: HFAdapter
    """Hugging Face key and config mapping."""
    plan: Callable[[TransformerConfig], ModelPlan]
    """The declarative parallelism plan of a config."""
