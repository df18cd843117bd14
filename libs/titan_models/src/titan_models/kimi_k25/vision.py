"""MoonViT, the Kimi K2.5 vision tower, assembled from ``components.vision``.

patches → ``PatchEmbed`` (+ the learned ``H × W`` position grid resampled bicubically to
each image, + a sinusoidal term per frame of a video clip) → ``num_layers`` ``VisionBlock``s
(2-D RoPE; every clip one bidirectional attention document) → final LayerNorm → mean over
the frames of a clip → ``PatchMerger`` (LayerNorm, 2 × 2 patches concatenated, GELU MLP)
into the text width.

Input layout is the Kimi K2.5 image processor's: each image's patches row by row (raster
order), every patch ``C·P·P`` values (``(N, C, P, P)`` is flattened). The merged tokens come
out row by row over the ``h/m × w/m`` grid, the order of the placeholders.

Shapes: N patches of the batch, D tower width, T merged tokens, O text width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..components.init import Init, Normal, prefixed
from ..components.vision import (
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionRotaryEmbedding,
    vision_attention_metadata,
)
from ..components.vision.encoder import layer_norm_init
from .config import KimiK25VisionConfig


def time_embeddings(frames: int, dim: int) -> torch.Tensor:
    """``(frames, D)`` sinusoids of frame numbers ``0 .. frames-1``: sines of ``D/2``
    frequencies ``10000^(-2i/D)``, then their cosines."""
    inv_freq = 10_000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class GridPositionEmbedding(nn.Module):
    """A learned ``(H, W, D)`` position grid, resampled bicubically (corners not aligned) to
    each image's ``h × w`` patch grid; frame ``f`` of a clip of ``t > 1`` frames also gets
    the sinusoid of ``f`` (a still image none)."""

    def __init__(self, *, height: int, width: int, frames: int, dim: int) -> None:
        super().__init__()
        self.frames, self.dim = frames, dim
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(N, D)`` embeddings of the patches of ``grids`` (raster order per frame). Each
        distinct ``h × w`` is resampled once; one gather spreads them over the images."""
        H, W = self.weight.shape[:2]
        table_1DHW = self.weight.permute(2, 0, 1)[None]
        sizes = list(dict.fromkeys((int(h), int(w)) for _, h, w in grids))
        tables, offsets, at = [], {}, 0
        for h, w in sizes:
            if (h, w) == (H, W):
                grid_HWD = self.weight
            else:
                grid_HWD = F.interpolate(
                    table_1DHW, size=(h, w), mode="bicubic", align_corners=False
                )[0].permute(1, 2, 0)
            tables.append(grid_HWD.reshape(h * w, -1))
            offsets[(h, w)] = at
            at += h * w
        index = torch.cat(
            [torch.arange(h * w).repeat(t) + offsets[(h, w)] for t, h, w in grids]
        ).to(self.weight.device)
        pos_ND = torch.cat(tables).index_select(0, index)
        clips = [(t, h, w) for t, h, w in grids if t > 1]
        if not clips:
            return pos_ND
        if max(t for t, _, _ in clips) > self.frames:
            t = max(t for t, _, _ in clips)
            raise ValueError(f"a clip of t={t} frames exceeds vision pos_emb_time={self.frames}")
        # frame f of a clip of t > 1 frames: + sinusoid f; a still image: + nothing
        frame = torch.cat(
            [
                (torch.arange(t) + 1).repeat_interleave(h * w) if t > 1 else torch.zeros(h * w)
                for t, h, w in grids
            ]
        ).long()
        time_FD = torch.cat([torch.zeros(1, self.dim), time_embeddings(self.frames, self.dim)])
        return pos_ND + time_FD.to(pos_ND)[frame.to(pos_ND.device)]

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        return {"weight": Normal(std)}


class KimiK25VisionTower(nn.Module):
    """Images → ``(T, O)`` tokens, one per ``m × m`` block of each image (see the module
    docstring)."""

    def __init__(self, config: KimiK25VisionConfig, *, out_dim: int, projection_eps: float) -> None:
        super().__init__()
        c = self.config = config
        self.patch_embed = PatchEmbed(
            dim=c.dim, patch_size=c.patch_size, temporal_patch_size=1, in_channels=c.in_channels
        )
        self.pos_embed = GridPositionEmbedding(
            height=c.pos_emb_height, width=c.pos_emb_width, frames=c.pos_emb_time, dim=c.dim
        )
        self.rope = VisionRotaryEmbedding(c.head_dim, theta=c.rope_theta)
        self.blocks = nn.ModuleList(
            VisionBlock(
                dim=c.dim,
                num_heads=c.num_heads,
                hidden_dim=c.ffn_hidden_dim,
                norm_eps=c.norm_eps,
                activation=c.activation,
            )
            for _ in range(c.num_layers)
        )
        self.final_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.merger: PatchMerger = PatchMerger(
            dim=c.dim,
            out_dim=out_dim,
            spatial_merge_size=c.spatial_merge_size,
            norm_eps=projection_eps,
        )

    def forward(
        self, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]], *, backend: str = "auto"
    ) -> torch.Tensor:
        """``(T, O)`` tokens of every image (in ``grids`` order).

        Args:
            pixel_values: ``(N, C, P, P)`` or ``(N, C·P·P)`` patches, each image's row by row.
            grids: ``(t, h, w)`` patch grid of each image, host ints.
            backend: attention backend (``attention_backends()``) of the blocks.
        """
        m = self.config.spatial_merge_size
        pixels_NP = (
            pixel_values.reshape(pixel_values.shape[0], -1)
            if pixel_values.dim() == 4
            else pixel_values
        )
        patches = sum(t * h * w for t, h, w in grids)
        if patches != pixels_NP.shape[0]:
            raise ValueError(
                f"pixel_values hold {pixels_NP.shape[0]} patches but image_grid_thw {list(grids)} "
                f"describes {patches}"
            )
        bad = [g for g in grids if g[1] % m or g[2] % m]
        if bad:
            raise ValueError(f"image grid {bad[0]} is not divisible by spatial_merge_size={m}")
        device = pixels_NP.device
        x_ND = self.patch_embed(pixels_NP)
        x_ND = x_ND + self.pos_embed(grids).to(x_ND.dtype)
        coords_N2 = torch.cat(
            [
                torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)
                .reshape(h * w, 2)
                .repeat(t, 1)
                for t, h, w in grids
            ]
        ).to(device)
        rope = self.rope(coords_N2, x_ND.dtype)
        # one attention document per clip (all its frames): a grid (1, t·h, w) has t·h·w patches
        meta = vision_attention_metadata(
            [(1, t * h, w) for t, h, w in grids], device, backend=backend
        )
        x_1ND = x_ND[None]
        for block in self.blocks:
            x_1ND = block(x_1ND, rope, meta)
        x_ND = self.final_norm(x_1ND[0])
        return self.merger(self._pooled_blocks(x_ND, grids))

    def _pooled_blocks(self, x_ND: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Per image: the mean over its frames, its patches in ``m × m`` block order (one
        gather when every image is a still one)."""
        m, start, order = self.config.spatial_merge_size, 0, []
        for t, h, w in grids:
            raster = torch.arange(h * w).view(h // m, m, w // m, m).permute(0, 2, 1, 3)
            order.append(raster.flatten() + start)
            start += t * h * w
        if all(t == 1 for t, _, _ in grids):
            return x_ND.index_select(0, torch.cat(order).to(x_ND.device))
        out, start = [], 0
        for (t, h, w), first in zip(grids, order, strict=True):
            frames = x_ND[start : start + t * h * w].reshape(t, h * w, -1)
            mean = frames.float().mean(0).to(x_ND.dtype) if t > 1 else frames[0]
            out.append(mean.index_select(0, (first - start).to(x_ND.device)))
            start += t * h * w
        return torch.cat(out)

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Every matrix and the position grid Normal ``std``, the blocks' residual outputs
        Normal ``std / √(2·num_layers)``; LayerNorms identity, biases zero."""
        block_out = std / math.sqrt(2 * self.config.num_layers)
        inits = prefixed("patch_embed", self.patch_embed.param_init(std=std))
        inits |= prefixed("pos_embed", self.pos_embed.param_init(std=std))
        for i, block in enumerate(self.blocks):
            block_init = cast(Any, block).param_init  # a ModuleList's items read as Module
            inits |= prefixed(f"blocks.{i}", block_init(std=std, out_std=block_out))
        inits |= prefixed("final_norm", layer_norm_init(self.final_norm))
        return inits | prefixed("merger", self.merger.param_init(std=std))
