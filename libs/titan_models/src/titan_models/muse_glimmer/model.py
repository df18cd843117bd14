"""Muse Glimmer (Meta, 2026): a dense GQA decoder with iRoPE and post-norms, reading images.

Single-device code: parallelism is applied from outside, from ``plan.py``. The stack is
``components.Transformer`` (embedding → blocks → norm → head); what is Muse Glimmer's:

- the token embedding is RMS-normed without a scale (outside the embedding module, so a
  vocabulary-parallel embedding normalises the reduced rows);
- ``GatedAttention``: q / k / v → RMSNorm of every head without a scale → the queries times
  ``qk_scale_factor`` (folded into the softmax scale) → RoPE, except on the NoPE layers →
  causal attention, sliding-window on the layers that slide → times ``sigmoid(wg x)`` → wo;
- ``GlimmerBlock``: gain-centred RMSNorms (``1 + weight``) before *and after* each
  sub-layer, the post-norm on the branch before the residual add; SwiGLU;
- the final norm is a plain RMSNorm, and the head ``SoftCappedLinear``:
  ``cap · tanh(multiplier · logits / cap)``;
- images: the tower's tokens (``vision.py``) replace the placeholder embeddings; text
  positions stay 1-D.

Shapes: B batch, S sequence, D model dim, H query heads, K kv heads, E head dim, T image
tokens of the batch, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ..components import AttentionMetadata, FeedForward, KVCache, LayerKVCache, RMSNorm
from ..components.attention import cached_keys
from ..components.backends import attend
from ..components.init import Init, Normal, prefixed
from ..components.norm import unit_rms
from ..components.output_head import SoftCappedLinear
from ..components.rope import apply_rotary
from ..components.transformer import Transformer
from ..components.vision import check_placeholders, grid_list, placeholder_index, scatter
from .config import MuseGlimmerConfig
from .vision import MuseGlimmerVisionTower


class GatedAttention(nn.Module):
    """Causal GQA with scaleless QK-norm, a query scale, optional RoPE and a sigmoid output
    gate (see the module docstring)."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        norm_eps: float,
        query_scale: float,
        rotary: bool,
        window: int | None,
    ) -> None:
        """``query_scale``: multiplier of the normed queries (``qk_scale_factor``);
        ``rotary``: False on a NoPE layer; ``window``: this layer's sliding window."""
        super().__init__()
        self.head_dim, self.norm_eps, self.rotary, self.window = head_dim, norm_eps, rotary, window
        self.softmax_scale = query_scale / math.sqrt(head_dim)
        self.backend: str | None = None
        """This layer's attention backend instead of the run's (``None``: the run's)."""
        self.wq = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wg = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BSHE = unit_rms(self.wq(x_BSD).view(B, S, -1, self.head_dim), eps=self.norm_eps)
        k_BSKE = unit_rms(self.wk(x_BSD).view(B, S, -1, self.head_dim), eps=self.norm_eps)
        v_BSKE = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.rotary:
            q_BSHE, k_BSKE = apply_rotary(q_BSHE, rope), apply_rotary(k_BSKE, rope)
        k_BLKE, v_BLKE = cached_keys(kv_cache, meta, k_BSKE, v_BSKE)
        o_BSHE = attend(
            q_BSHE,
            k_BLKE,
            v_BLKE,
            meta,
            window=self.window,
            scale=self.softmax_scale,
            backend=self.backend,
        )
        gated = o_BSHE.reshape(B, S, -1) * torch.sigmoid(self.wg(x_BSD))
        return self.wo(gated)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` into the heads and the gate, ``out_std`` for the residual ``wo``."""
        inits: dict[str, Init] = {f"{n}.weight": Normal(std) for n in ("wq", "wk", "wv", "wg")}
        return inits | {"wo.weight": Normal(out_std)}


class GlimmerBlock(nn.Module):
    """``h = x + post_attn(attn(norm(x))); out = h + post_ffn(ffn(norm(h)))``, every norm
    gain-centred."""

    def __init__(self, config: MuseGlimmerConfig, layer: int) -> None:
        super().__init__()
        c = config

        def norm(eps: float) -> RMSNorm:
            return RMSNorm(c.dim, eps=eps, offset=1.0)

        self.attention_norm = norm(c.norm_eps)
        self.attention = GatedAttention(
            dim=c.dim,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            norm_eps=c.norm_eps,
            query_scale=c.qk_scale_factor,
            rotary=layer not in c.nope_layers,
            window=c.layer_window(layer),
        )
        self.post_attention_norm = norm(c.post_norm_eps)
        self.ffn_norm = norm(c.norm_eps)
        self.feed_forward = FeedForward(dim=c.dim, hidden_dim=c.ffn_hidden_dim)
        self.post_ffn_norm = norm(c.post_norm_eps)

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        attn_BSD = self.attention(self.attention_norm(x_BSD), rope, meta, kv_cache)
        h_BSD = x_BSD + self.post_attention_norm(attn_BSD)
        return h_BSD + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h_BSD)))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Norms to a scale of one (weight zero), projections as their modules say."""
        inits: dict[str, Init] = {}
        for name, module in self.named_children():
            inits |= prefixed(name, cast(Any, module).param_init(std=std, out_std=out_std))
        return inits


class MuseGlimmer(Transformer):
    """Muse Glimmer: ``Transformer`` of ``GlimmerBlock``s with a normed embedding, a
    soft-capped head and ``visual`` (the tower and its adapter)."""

    def __init__(self, config: MuseGlimmerConfig) -> None:
        visual = MuseGlimmerVisionTower(
            config.vision,
            out_dim=config.dim,
            projector_dim=config.projector_hidden_dim,
            norm_eps=config.norm_eps,
        )
        self.visual: MuseGlimmerVisionTower | None
        blocks = [GlimmerBlock(config, i) for i in range(config.num_layers)]
        super().__init__(config, blocks, extra_modules={"visual": visual})
        plain = self.output
        assert plain is not None  # just built
        with torch.device("meta"):  # the weight is taken over: nothing new is allocated
            head = SoftCappedLinear(
                config.dim,
                config.vocab_size,
                multiplier=config.output_multiplier,
                cap=config.logit_softcap,
            )
        head.weight = plain.weight
        self.output = head

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
    ) -> torch.Tensor:
        """Soft-capped logits ``(B, S, V)`` for token ids ``(B, S)`` with images at their
        placeholders.

        Args:
            pixel_values: ``(patches, T·C·P·P)`` of every image of the batch, images in
                placeholder order, each image's patches row by row (the Muse Glimmer image
                processor's ``pixel_values``).
            image_grid_thw: ``(images, 3)`` patch grid ``(t, h, w)`` of each image (host ints
                or a tensor, read on the host).
            image_index: ``(T,)`` flat indices in ``B·S`` of the placeholder tokens; by
                default found in ``tokens`` (one host read).
            positions, document_ids, kv_cache, input_lengths: as ``Transformer.forward``; a
                step into a KV cache may carry images too (nothing about them outlives it).
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

    def run_blocks(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        image_index: torch.Tensor | None = None,
        **inputs,
    ) -> tuple[torch.Tensor, tuple]:
        """``Transformer.run_blocks`` on the normed token embeddings with the images
        scattered in (a pipeline stage without the embedding passes its input through)."""
        grids = grid_list(image_grid_thw)
        if pixel_values is None and grids:
            raise ValueError("image_grid_thw given without pixel_values")
        if self.tok_embeddings is None:
            if pixel_values is not None:
                raise ValueError("pixel_values given to a model part without the embedding")
            return super().run_blocks(tokens, **inputs)
        config = cast(MuseGlimmerConfig, self.config)
        # Media placeholders embed as token 0 (as transformers'; a video id may lie past the
        # vocabulary); an image's tokens then replace them.
        media = (tokens == config.image_token_id) | (tokens == config.video_token_id)
        h_BSD = self.tok_embeddings(tokens.masked_fill(media, 0))
        h_BSD = unit_rms(h_BSD, eps=config.norm_eps)
        if pixel_values is not None:
            visual = self.visual if "visual" in self._modules else None
            if visual is None:
                raise ValueError("pixel_values given to a model part without the vision tower")
            if self.context_parallel is not None:
                raise ValueError("pixel_values cannot be combined with context parallelism yet")
            if not grids:
                raise ValueError("pixel_values need image_grid_thw (the patch grid of each image)")
            features_TD = visual(pixel_values, grids, backend=config.attention_backend)
            if image_index is None:
                image_index = placeholder_index(tokens, config.image_token_id)
            check_placeholders(image_index, features_TD.shape[0])
            h_BSD = scatter(h_BSD, image_index, features_TD)
        return super().run_blocks(tokens, embeddings=h_BSD, **inputs)

    def _extra_param_inits(self, *, std: float, out_std: float) -> dict[str, Init]:
        visual = self.visual if "visual" in self._modules else None
        if visual is None:
            return {}
        return prefixed("visual", visual.param_init(std=std, out_std=out_std))
