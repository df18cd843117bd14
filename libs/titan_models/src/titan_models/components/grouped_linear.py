"""A block-diagonal linear map: ``G`` groups of the input, each projected on its own.

DeepSeek-V4's grouped output projection (§2.3.1): the ``H·E`` attention outputs are cut into
``G`` groups of heads, each group projected to ``R`` features, and the ``G·R`` results mixed by
one ordinary linear afterwards; ``H·E·R`` weights instead of ``H·E·D``.

The weight is stored as HF stores it, ``(G·R, I)`` with group ``g`` in rows ``[g·R, (g+1)·R)``;
the number of groups is read off the weight at run time, so a tensor-parallel plan that shards
the rows by groups (with the heads feeding them) needs no change here.

Shapes: N leading dims, G groups, I input features per group, R output features per group.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedLinear(nn.Module):
    """``y[..., g, :] = x[..., g, :] @ W_g^T`` for every group ``g``."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        """``in_features`` / ``out_features``: per group."""
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if value < 1:
                raise ValueError(f"GroupedLinear.{name} must be >= 1, got {value}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))

    def forward(self, x_NGI: torch.Tensor) -> torch.Tensor:
        """``(..., G, I)`` → ``(..., G, R)``."""
        w_GRI = self.weight.view(-1, self.out_features, self.in_features)
        G = w_GRI.shape[0]
        x_GMI = x_NGI.reshape(-1, G, self.in_features).transpose(0, 1)
        y_GMR = torch.bmm(x_GMI, w_GRI.transpose(1, 2))
        return y_GMR.transpose(0, 1).reshape(*x_NGI.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        groups = self.weight.shape[0] // self.out_features
        return f"groups={groups}, in_features={self.in_features}, out_features={self.out_features}"


__all__ = ["GroupedLinear"]
