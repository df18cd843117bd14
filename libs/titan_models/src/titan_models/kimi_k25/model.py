"""Kimi K2.5 (Moonshot AI, 2026): the DeepSeek-V3 decoder reading images through MoonViT.

Single-device code: parallelism is applied from outside, from ``plan.py``. The decoder is
``DeepSeekV3`` unchanged (MLA, dense-then-MoE blocks, optional MTP); ``visual`` is the
``KimiK25VisionTower``. ``forward(tokens, pixel_values=, image_grid_thw=, ...)``: the tower
encodes every image of the batch in one call, its merged tokens replace the embeddings of
the placeholder tokens in row-major order, and the blocks run on that as on text (1-D RoPE
positions: an image token takes one position like any other token). Without
``pixel_values`` the model is the DeepSeek-V3 text decoder.

Shapes: B batch, S sequence, D model dim, T image tokens of the batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ..components import KVCache
from ..components.init import Init, prefixed
from ..components.vision import check_placeholders, grid_list, placeholder_index, scatter
from ..deepseek_v3 import DeepSeekV3
from .config import KimiK25Config
from .vision import KimiK25VisionTower


class KimiK25(DeepSeekV3):
    """Kimi K2.5 / K2.6 / K2.7: ``DeepSeekV3`` + ``visual`` (MoonViT and its projector)."""

    def __init__(self, config: KimiK25Config) -> None:
        visual = KimiK25VisionTower(
            config.vision, out_dim=config.dim, projection_eps=config.projection_norm_eps
        )
        self.visual: KimiK25VisionTower | None
        super().__init__(config, extra_modules={"visual": visual})

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        image_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        input_lengths: torch.Tensor | None = None,
        return_mtp: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Logits ``(B, S, V)`` for token ids ``(B, S)`` with images at their placeholders.

        Args:
            pixel_values: ``(patches, C, P, P)`` or ``(patches, C·P·P)`` of every image of the
                batch, images in placeholder order, each image's patches row by row (the
                Kimi K2.5 image processor's ``pixel_values``).
            image_grid_thw: ``(images, 3)`` patch grid ``(t, h, w)`` of each image (host ints
                or a tensor, read on the host).
            image_index: ``(T,)`` flat indices in ``B·S`` of the placeholder tokens (known to
                the data pipeline); by default found in ``tokens`` (one host read).
            positions, document_ids, kv_cache, input_lengths, return_mtp: as
                ``DeepSeekV3.forward``; a step into a KV cache may carry images too (the
                positions are plain, so nothing about an image outlives its step).
        """
        inputs = dict(
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            image_index=image_index,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
        )
        return self.logits_and_mtp(tokens, inputs, return_mtp=return_mtp)

    def run_blocks(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        image_index: torch.Tensor | None = None,
        **inputs,
    ) -> tuple[torch.Tensor, tuple]:
        """``Transformer.run_blocks`` on the token embeddings with the images scattered in."""
        grids = grid_list(image_grid_thw)
        if pixel_values is None:
            if grids:
                raise ValueError("image_grid_thw given without pixel_values")
            return super().run_blocks(tokens, **inputs)
        visual = self.visual if "visual" in self._modules else None
        if visual is None or self.tok_embeddings is None:
            raise ValueError("pixel_values given to a model part without the vision tower")
        if self.context_parallel is not None:
            raise ValueError("pixel_values cannot be combined with context parallelism yet")
        if not grids:
            raise ValueError("pixel_values need image_grid_thw (the patch grid of each image)")
        features_TD = visual(pixel_values, grids, backend=self.config.attention_backend)
        if image_index is None:
            config = cast(KimiK25Config, self.config)
            image_index = placeholder_index(tokens, config.image_token_id)
        check_placeholders(image_index, features_TD.shape[0])
        h_BSD = scatter(self.tok_embeddings(tokens), image_index, features_TD)
        return super().run_blocks(tokens, embeddings=h_BSD, **inputs)

    def _extra_param_inits(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits = super()._extra_param_inits(std=std, out_std=out_std)
        visual = self.visual if "visual" in self._modules else None
        if visual is not None:
            inits |= prefixed("visual", visual.param_init(std=std, out_std=out_std))
        return inits
