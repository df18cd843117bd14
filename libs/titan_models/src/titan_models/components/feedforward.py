"""SwiGLU feed-forward (Shazeer, 2020): ``w2(silu(w1 x) * w3 x)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import Init, Normal


class FeedForward(nn.Module):
    """Gated MLP; ``w1`` is the gate, ``w3`` the up projection, ``w2`` the down projection."""

    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` for the input projections, ``out_std`` for the residual output ``w2``."""
        return {"w1.weight": Normal(std), "w3.weight": Normal(std), "w2.weight": Normal(out_std)}
