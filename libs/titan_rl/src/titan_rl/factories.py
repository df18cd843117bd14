"""Picklable factories for the processes of a distributed run (``titan_rl.actors``).

A factory travels to an actor process and builds there what the controller must not hold:
the model (``TitanModelFactory``) or a generator over it (``TorchGeneratorFactory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import titan_models

from .generator import TorchGenerator


@dataclass(frozen=True, kw_only=True, slots=True)
class TitanModelFactory:
    """``factory(device)``: a titan_models model built on ``meta`` and initialised on
    ``device`` from ``seed`` (the same weights in every process)."""

    family: str
    """A ``titan_models.get_model`` family (``llama3``, ``qwen3``, ...)."""
    flavor: str
    """Its flavour (``debug``, ``8B``, ...)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields to override (``vocab_size``, ``num_layers``, ...)."""
    seed: int = 0
    """Initialisation seed."""

    def __call__(self, device: torch.device) -> nn.Module:
        model_cls, config = titan_models.get_model(self.family, self.flavor, **self.overrides)
        with torch.device("meta"):
            model = model_cls(config)
        return model.init_weights(device=device, seed=self.seed)


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchGeneratorFactory:
    """Replica ``i``: a ``TorchGenerator`` over ``model_factory(device)``; on CUDA, device
    ``(first_device + i) % device_count`` (put the generators after the trainer's ranks)."""

    model_factory: Callable[[torch.device], nn.Module]
    """Builds the generator's copy of the policy (its weights arrive by publication)."""
    batch_invariant: bool = False
    """``TorchGenerator(batch_invariant=...)``."""
    compile_decode: bool = False
    """``TorchGenerator(compile_decode=...)``."""
    first_device: int = 0
    """CUDA device of replica 0."""

    def __call__(self, index: int) -> TorchGenerator:
        device = torch.device("cpu")
        if torch.cuda.is_available():
            device = torch.device("cuda", (self.first_device + index) % torch.cuda.device_count())
        return TorchGenerator(
            self.model_factory(device),
            batch_invariant=self.batch_invariant,
            compile_decode=self.compile_decode,
        )
