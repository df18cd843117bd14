"""What the registry knows about one model family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .components import Transformer, TransformerConfig
from .hf_adapter import HFAdapter
from .plan import ModelPlan

_C = TypeVar("_C", bound=TransformerConfig)


class ModelClass(Protocol):
    """A family's ``Transformer`` subclass: built as ``model_cls(config)``."""

    __name__: str

    def __call__(self, config: Any, /) -> Transformer: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily(Generic[_C]):
    """A family's model class, config class, named flavours, HF adapter and plan."""

    name: str
    """Registry name, e.g. ``llama3``."""
    model_cls: ModelClass
    """Built as ``model_cls(config)``."""
    config_cls: type[_C]
    """The family's config dataclass."""
    flavors: Mapping[str, _C]
    """Named configs, smallest first, ``debug`` among them."""
    hf_adapter: HFAdapter[_C]
    """Hugging Face key and config mapping."""
    plan: Callable[[_C], ModelPlan]
    """The declarative parallelism plan of a config."""
