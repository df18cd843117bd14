"""Patch merger: every ``m × m`` block of neighbouring patches becomes one token of the
language model's width (LayerNorm, then a 2-layer GELU MLP over the block's concatenated
features).

The patches of a block arrive consecutively (the image processor's merge-block order), so a
block is a plain reshape. The norm runs on each patch before the concatenation (Qwen3-VL's
final merger) or on the concatenated block after it (its DeepStack mergers:
``postshuffle_norm``).

Shapes: N patches, D vision width, M = N / m² merged tokens, O output width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..init import Init, prefixed
from .encoder import layer_norm_init, linear_init


class PatchMerger(nn.Module):
    """``(N, D)`` patches → ``(N / m², O)`` tokens."""

    def __init__(
        self,
        *,
        dim: int,
        out_dim: int,
        spatial_merge_size: int,
        norm_eps: float = 1e-6,
        postshuffle_norm: bool = False,
    ) -> None:
        super().__init__()
        self.block_dim = dim * spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.block_dim if postshuffle_norm else dim, eps=norm_eps)
        self.w1 = nn.Linear(self.block_dim, self.block_dim, bias=True)
        self.w2 = nn.Linear(self.block_dim, out_dim, bias=True)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x_MF = self.norm(x_ND.reshape(-1, self.block_dim))
        else:
            x_MF = self.norm(x_ND).reshape(-1, self.block_dim)
        return self.w2(F.gelu(self.w1(x_MF)))

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Norm to identity, both projections Normal ``std``, biases 0."""
        return (
            prefixed("norm", layer_norm_init(self.norm))
            | prefixed("w1", linear_init(self.w1, std))
            | prefixed("w2", linear_init(self.w2, std))
        )
