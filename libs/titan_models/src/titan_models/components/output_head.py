"""An output head with a tanh soft cap on its logits (Gemma 2, Muse Glimmer).

The cap is part of the head module, not of the model's forward, so anything that computes
the logits from the head's weight itself — the app's chunked cross-entropy, which never
materialises all logits at once — finds the transform on the module (``soft_cap``) and
applies it to each chunk: the loss is that of the capped logits whichever way it is computed.
"""

from __future__ import annotations

import torch
from torch import nn


class SoftCappedLinear(nn.Linear):
    """Bias-free ``x Wᵀ`` followed by ``cap · tanh(multiplier · logits / cap)``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        multiplier: float,
        cap: float,
        device: torch.device | str | None = None,
    ) -> None:
        """``multiplier``: scale of the raw logits before the cap; ``cap``: their bound."""
        super().__init__(in_features, out_features, bias=False, device=device)
        if not cap > 0 or not multiplier > 0:
            raise ValueError(
                f"SoftCappedLinear cap={cap!r} and multiplier={multiplier!r} must be > 0"
            )
        self.multiplier, self.cap = multiplier, cap

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.soft_cap(super().forward(input))

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """The cap applied to raw logits ``x Wᵀ`` (in their dtype)."""
        return self.cap * torch.tanh(logits * (self.multiplier / self.cap))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, multiplier={self.multiplier}, cap={self.cap}"
