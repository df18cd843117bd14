"""A decoder-only language model that reads images: the ``Transformer`` with a vision tower
whose tokens replace the image placeholders, DeepStack features added after the first
decoder layers, and multimodal RoPE.

``forward(tokens, pixel_values=, image_grid_thw=, ...)``: the tower encodes every image of the
batch in one call (images as documents of one bidirectional attention), its tokens replace
the placeholder embeddings in row-major order, and the 3-axis positions come from where the
placeholders are (``batch_multimodal_positions``) unless given. Packed documents restart
their positions; a KV cache remembers, per row, how far the positions of later (text) steps
are shifted (``MultimodalKVCache.position_offsets``), so a prompt with images prefills once
and decodes token by token through the same forward.

A family supplies the tower (``forward(pixel_values, grids, backend=) -> (tokens, [DeepStack
features])`` and ``param_init(std=, out_std=)``) and a config with ``image_token_id`` and
the M-RoPE fields. Without ``pixel_values`` the model is a plain text decoder (M-RoPE on text
equals RoPE).

Shapes: B batch, S sequence, D model dim, T image tokens of the batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..attention import build_attention_metadata
from ..init import Init, prefixed
from ..kv_cache import KVCache
from ..transformer import Transformer, TransformerConfig, check_input_lengths
from .deepstack import add_at, check_placeholders, placeholder_index, scatter
from .rotary import MultimodalRotaryEmbedding, batch_multimodal_positions


class MultimodalKVCache(KVCache):
    """A ``KVCache`` that also keeps each row's M-RoPE offset: later tokens take position
    ``plain position + position_offsets[row]`` (an image spans fewer positions than tokens)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.position_offsets = torch.zeros_like(self.lengths)
        """``(B,)`` added to the plain positions of every later step."""

    def reset(self) -> None:
        super().reset()
        self.position_offsets.zero_()


def grid_list(image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None) -> list[tuple]:
    """``(t, h, w)`` of every image as host ints (a ``(n, 3)`` tensor is read once)."""
    if image_grid_thw is None:
        return []
    rows = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else image_grid_thw
    grids = [tuple(int(x) for x in row) for row in rows]
    bad = [g for g in grids if len(g) != 3 or min(g) < 1]
    if bad:
        raise ValueError(f"image_grid_thw must hold (t, h, w) with every entry >= 1, got {bad[0]}")
    return grids


class VisionLanguageTransformer(Transformer):
    """``Transformer`` + ``visual`` tower + DeepStack + M-RoPE (see the module docstring)."""

    visual: nn.Module  # registered by Transformer.__init__ (extra_modules)

    def __init__(
        self,
        config: TransformerConfig,
        blocks: Sequence[nn.Module],
        *,
        visual: nn.Module,
        rope: MultimodalRotaryEmbedding,
    ) -> None:
        super().__init__(config, blocks, extra_modules={"visual": visual})
        self.rope = rope
        vl_config: Any = config  # a TransformerConfig with VisionLanguageFields
        self.image_token_id: int = vl_config.image_token_id
        self.spatial_merge_size: int = vl_config.vision.spatial_merge_size

    def forward(
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
    ) -> torch.Tensor:
        """Logits ``(B, S, V)`` for token ids ``(B, S)`` with images at their placeholders.

        Args:
            pixel_values: ``(patches, C·T·P·P)`` flattened patches of every image of the batch
                (the HF image processor's ``pixel_values``), images in placeholder order.
            image_grid_thw: ``(images, 3)`` patch grid ``(t, h, w)`` of each image (host ints
                or a tensor, read on the host).
            image_index: ``(T,)`` flat indices in ``B·S`` of the placeholder tokens (known to
                the data pipeline); by default found in ``tokens`` (one host read).
            positions: ``(3, B, S)`` M-RoPE positions, or ``(B, S)`` plain ones (all three
                axes equal); by default derived from the placeholders (host) with images, the
                document / cache positions without.
            document_ids, kv_cache, input_lengths: as ``Transformer.forward``; images only in
                a step that reads no cached tokens (a prefill).
        """
        h_BSD, _ = self.run_blocks(
            tokens,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            image_index=image_index,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
        )
        return self.head(h_BSD)

    def run_blocks(  # pyrefly: ignore[bad-override]  # images in, its own embeddings
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
    ) -> tuple[torch.Tensor, tuple]:
        """Embedding (+ images), blocks (+ DeepStack): the residual stream before the final
        norm, and the ``(rope, attention metadata)`` the blocks used."""
        B, S = tokens.shape[:2]
        if positions is not None and tuple(positions.shape) not in ((3, B, S), (B, S)):
            raise ValueError(
                f"positions must have shape (3, {B}, {S}) (M-RoPE) or ({B}, {S}), got "
                f"{tuple(positions.shape)}"
            )
        if input_lengths is not None:
            check_input_lengths(input_lengths, B, S, kv_cache)
        grids = grid_list(image_grid_thw)
        meta = build_attention_metadata(
            B,
            S,
            tokens.device,
            positions=None,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
            backend=self.config.attention_backend,
            windows=self.config.attention_windows(),
        )
        h_BSD = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        deepstack: list[torch.Tensor] = []
        if pixel_values is not None:
            if getattr(self, "visual", None) is None:
                raise ValueError("pixel_values given to a model part without the vision tower")
            if meta.cache is not None and meta.cache.reads_cache:
                raise ValueError(
                    "images can only enter a step into an empty KV cache (a prefill); this step "
                    "reads cached tokens"
                )
            if not grids:
                raise ValueError("pixel_values need image_grid_thw (the patch grid of each image)")
            features_TD, deepstack = self.visual(
                pixel_values, grids, backend=self.config.attention_backend
            )
            if image_index is None:
                image_index = placeholder_index(tokens, self.image_token_id)
            check_placeholders(image_index, features_TD.shape[0])
            h_BSD = scatter(h_BSD, image_index, features_TD)
        elif grids:
            raise ValueError("image_grid_thw given without pixel_values")
        rope = self.rope(self._positions(tokens, grids, positions, meta, kv_cache), h_BSD.dtype)
        for index, layer in self.layers.items():
            layer_cache = kv_cache.layers[int(index)] if kv_cache is not None else None
            h_BSD = layer(h_BSD, rope, meta, layer_cache)
            if int(index) < len(deepstack):
                assert image_index is not None  # found with the images' features
                h_BSD = add_at(h_BSD, image_index, deepstack[int(index)])
        if kv_cache is not None:
            kv_cache.end(input_lengths)
        return h_BSD, (rope, meta)

    def _positions(self, tokens, grids, positions, meta, kv_cache) -> torch.Tensor:
        """``(3, B, S)`` M-RoPE positions of this forward (see ``forward``)."""
        B, S = tokens.shape[:2]
        offsets = getattr(kv_cache, "position_offsets", None)
        prefill = kv_cache is not None and not kv_cache_reads(meta)
        if positions is not None:
            return positions if positions.dim() == 3 else positions.expand(3, B, S)
        if grids:
            lengths = meta.cache.input_lengths if meta.cache is not None else None
            found, shift = batch_multimodal_positions(
                tokens,
                grids,
                image_token_id=self.image_token_id,
                spatial_merge_size=self.spatial_merge_size,
                document_ids=_document_ids(meta),
                lengths=lengths,
            )
            if offsets is not None:
                offsets.copy_(shift)
            return found.to(tokens.device)
        if offsets is not None and prefill:
            offsets.zero_()
        plain = meta.positions if offsets is None else meta.positions + offsets[:, None]
        return plain.expand(3, B, S)

    def _extra_param_inits(self, *, std: float, out_std: float) -> dict[str, Init]:
        visual = getattr(self, "visual", None)
        if visual is None:
            return {}
        return prefixed("visual", visual.param_init(std=std, out_std=out_std))

    def new_kv_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        static: bool = False,
    ) -> MultimodalKVCache:
        """An empty cache for this model's layers that also tracks each row's M-RoPE offset
        (``static``: as ``Transformer.new_kv_cache``)."""
        weight = next(self.parameters())
        heads, key_dim, value_dim = self.kv_cache_widths()
        return MultimodalKVCache(
            layers=[int(i) for i in self.layers],
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=heads,
            head_dim=key_dim,
            value_dim=value_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
            windows={int(i): self.config.layer_window(int(i)) for i in self.layers},
            static=static,
        )


def kv_cache_reads(meta) -> bool:
    """Whether this forward attends to tokens cached by earlier steps."""
    return meta.cache is not None and meta.cache.reads_cache


def _document_ids(meta) -> torch.Tensor | None:
    """Per-token document numbers of a packed batch (from where documents start)."""
    if meta.starts is None:
        return None
    return meta.starts
