"""An output head whose logits are scaled and soft-capped: ``cap · tanh(m · (h Wᵀ) / cap)``
(Gemma 2's final soft cap, with Muse Spark's output multiplier ``m`` in front).

The head stays an ``nn.Linear`` (same weight, same FQN, same tensor-parallel and pipeline
plans); ``cap_logits`` is the element-wise map after the matmul, so a loss that computes
the logits itself in chunks (the app's chunked cross-entropy head) applies it per chunk and
stays equal to the plain head.
"""

from __future__ import annotations

import torch
from torch import nn


class SoftcapLinear(nn.Linear):
    """Bias-free ``dim → vocab`` head followed by ``cap_logits``."""

    def __init__(
        self, dim: int, vocab_size: int, *, multiplier: float = 1.0, softcap: float | None = None
    ) -> None:
        """``multiplier``: scale of the raw logits; ``softcap``: the tanh cap (``None``: none)."""
        super().__init__(dim, vocab_size, bias=False)
        if not multiplier > 0:
            raise ValueError(f"SoftcapLinear multiplier must be > 0, got {multiplier!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"SoftcapLinear softcap must be > 0 or None, got {softcap!r}")
        self.multiplier = multiplier
        self.softcap = softcap

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The raw logits ``h Wᵀ`` scaled and soft-capped."""
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(super().forward(input))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, multiplier={self.multiplier}, softcap={self.softcap}"
