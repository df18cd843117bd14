"""Patch embedding of a vision encoder: each patch of ``temporal × patch × patch`` pixels in
``channels`` becomes one token.

An image processor (Qwen2-VL's, for Qwen3-VL) flattens every patch to ``C·T·P·P`` values in
channel, time, row, column order, and duplicates a still image ``T`` times in time (a video
clip brings ``T`` real frames): a 3-D convolution with kernel = stride = patch is then one
matrix product per patch, which is what this module computes (no convolution kernel, and a
weight a tensor-parallel plan or an optimizer sees as an ordinary matrix). ``T = 1`` is the
plain 2-D ViT patch embedding.

Shapes: N patches (all images of a batch, concatenated), D embedding width.
"""

from __future__ import annotations

import torch
from torch import nn

from ..init import Constant, Init, Normal


class PatchEmbed(nn.Module):
    """``(N, C·T·P·P)`` flattened patches → ``(N, D)`` tokens (a Conv3d with kernel = stride)."""

    def __init__(
        self,
        *,
        dim: int,
        patch_size: int,
        temporal_patch_size: int = 1,
        in_channels: int = 3,
        bias: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("dim", dim),
            ("patch_size", patch_size),
            ("temporal_patch_size", temporal_patch_size),
            ("in_channels", in_channels),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PatchEmbed {name} must be an int >= 1, got {value!r}")
        self.patch_shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Linear(in_channels * temporal_patch_size * patch_size**2, dim, bias=bias)

    def forward(self, pixels_NP: torch.Tensor) -> torch.Tensor:
        """Tokens of the flattened patches (cast to the weight's dtype)."""
        if pixels_NP.dim() != 2 or pixels_NP.shape[-1] != self.proj.in_features:
            c, t, p, _ = self.patch_shape
            raise ValueError(
                f"pixel_values must be (patches, {self.proj.in_features}) = (N, channels "
                f"{c} x temporal {t} x {p} x {p}), got {tuple(pixels_NP.shape)}"
            )
        return self.proj(pixels_NP.to(self.proj.weight.dtype))

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Normal ``std`` weight, zero bias."""
        inits: dict[str, Init] = {"proj.weight": Normal(std)}
        if self.proj.bias is not None:
            inits["proj.bias"] = Constant(0.0)
        return inits
