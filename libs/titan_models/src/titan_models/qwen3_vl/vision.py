"""The Qwen3-VL vision tower, assembled from ``components.vision``.

patches → ``PatchEmbed`` (+ the learned position grid resampled to each image) → ``num_layers``
``VisionBlock``s (2-D RoPE, every image its own attention document) → ``PatchMerger`` into the
text width; after each block listed in ``deepstack_layers`` a DeepStack merger (norm after
the 2×2 shuffle) makes one more set of text-width tokens, added after text layers 0, 1, ...

Shapes: N patches of the batch, D tower width, T = N / m² merged tokens, O text width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..components.init import Init, prefixed
from ..components.vision import (
    InterpolatedPositionEmbedding,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionRotaryEmbedding,
    patch_coordinates,
    vision_attention_metadata,
)
from .config import Qwen3VLVisionConfig


class Qwen3VLVisionTower(nn.Module):
    """Images → ``(T, O)`` tokens and one ``(T, O)`` DeepStack feature per listed layer."""

    def __init__(self, config: Qwen3VLVisionConfig, *, out_dim: int) -> None:
        super().__init__()
        c = config
        self.config = c
        self.patch_embed = PatchEmbed(
            dim=c.dim,
            patch_size=c.patch_size,
            temporal_patch_size=c.temporal_patch_size,
            in_channels=c.in_channels,
        )
        self.pos_embed = InterpolatedPositionEmbedding(
            num_embeddings=c.num_position_embeddings, dim=c.dim
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
        merger = dict(
            dim=c.dim, out_dim=out_dim, spatial_merge_size=c.spatial_merge_size, norm_eps=c.norm_eps
        )
        self.merger = PatchMerger(**merger)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(**merger, postshuffle_norm=True) for _ in c.deepstack_layers
        )

    def forward(
        self,
        pixels_NP: torch.Tensor,
        grids: Sequence[Sequence[int]],
        *,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Tokens of every image (in ``grids`` order) and the DeepStack features.

        Args:
            pixels_NP: ``(N, C·T·P·P)`` flattened patches, the images' patches in merge-block
                order (the HF image processor's ``pixel_values``).
            grids: ``(t, h, w)`` patch grid of each image, host ints.
            backend: attention backend (``attention_backends()``) of the blocks.
        """
        m = self.config.spatial_merge_size
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
        coords_N2 = torch.cat([patch_coordinates(g, m) for g in grids]).to(device)
        sizes_N2 = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids]).to(
            device
        )
        x_ND = self.patch_embed(pixels_NP) + self.pos_embed(coords_N2, sizes_N2)
        rope = self.rope(coords_N2, x_ND.dtype)
        meta = vision_attention_metadata(grids, device, backend=backend)
        x_1ND = x_ND[None]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x_1ND = block(x_1ND, rope, meta)
            if i in self.config.deepstack_layers:
                k = self.config.deepstack_layers.index(i)
                deepstack.append(self.deepstack_mergers[k](x_1ND[0]))
        return self.merger(x_1ND[0]), deepstack

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Every matrix and the position grid Normal ``std``, the blocks' residual outputs
        Normal ``std / √(2·num_layers)``; LayerNorms identity, biases zero."""
        block_out = std / math.sqrt(2 * self.config.num_layers)
        inits = prefixed("patch_embed", self.patch_embed.param_init(std=std))
        inits |= prefixed("pos_embed", self.pos_embed.param_init(std=std))
        for i, block in enumerate(self.blocks):
            assert isinstance(block, VisionBlock)
            inits |= prefixed(f"blocks.{i}", block.param_init(std=std, out_std=block_out))
        inits |= prefixed("merger", self.merger.param_init(std=std))
        for i, merger in enumerate(self.deepstack_mergers):
            assert isinstance(merger, PatchMerger)
            inits |= prefixed(f"deepstack_mergers.{i}", merger.param_init(std=std))
        return inits
