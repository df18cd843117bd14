"""Muse Spark Open: ``meta-models/Muse-Spark-Open-816B-A42B``, its decoder and towers.

Single-device code: parallelism (experts included) is applied from outside, from ``plan.py``.
The stack is ``components.Transformer`` (embedding → blocks → final RMSNorm → head) with:

- the token embedding normalised without a scale (``unit_rms``) before the first block;
- a block that normalises both sub-layers' inputs *and* outputs and joins each to the stream
  through a ``ResidualGate``::

      x = gate_attn(x, post_attn_norm(attention(attention_norm(x))))
      x = gate_ffn(x, post_ffn_norm(feed_forward(ffn_norm(x))))

  (``attention_norm`` / ``ffn_norm`` zero-centred, ``post_attn_norm`` scaleless,
  ``post_ffn_norm`` input-scaled);
- ``GatedAttention`` with the layer's RoPE base (NoPE where it is 0) and its window;
- a dense SwiGLU or a ``PooledMoE`` per layer (``mlp_layer_types``, any order);
- a head that scales its logits by ``output_multiplier`` and soft-caps them
  (``SoftCappedLinear``; the app's chunked loss applies the same cap per chunk);
- media: ``visual`` (Muse Glimmer's tower and adapter, ``muse_glimmer/vision.py``) and
  ``audio`` (``audio.py``) make text-width tokens that replace the embeddings of their
  placeholders (image / audio token ids; placeholders embed as token 0 first). The audio
  tokens are normalised without a scale, as the text embeddings are. Positions stay 1-D.

Shapes: B batch, S sequence, D model dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from dist_moe import RouterConfig

from ..components import (
    AttentionMetadata,
    FeedForward,
    Init,
    InputScaledRMSNorm,
    KVCache,
    LayerKVCache,
    RMSNorm,
    RopeConfig,
    RotaryEmbedding,
    SoftCappedLinear,
    Transformer,
    unit_rms,
)
from ..components.init import prefixed
from ..components.vision import check_placeholders, grid_list, placeholder_index, scatter
from ..muse_glimmer.vision import MuseGlimmerVisionTower
from .audio import MuseSparkAudioTower, audio_token_mask
from .config import MuseSparkConfig
from .layers import GatedAttention, PooledMoE, ResidualGate


def router_config(config: MuseSparkConfig) -> RouterConfig:
    """dist_moe routing that reproduces HF ``MuseSparkTopkRouter``: sigmoid scores of fp32
    logits, top-k on scores + selection bias, renormalised, times ``route_scale``."""
    return RouterConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        score_func="sigmoid",
        norm_topk_prob=True,
        route_scale=config.route_scale,
        bias_update_rate=config.bias_update_rate,
        seq_aux_loss_coef=config.aux_loss_coef,
    )


class MuseSparkBlock(nn.Module):
    """Pre- and post-normed attention and feed-forward, each joined by a residual gate."""

    def __init__(self, config: MuseSparkConfig, layer: int) -> None:
        super().__init__()
        c = config
        theta = c.rope_theta(layer)
        own_rope = None
        if theta and theta != c.rope.theta:  # a base of its own: tables of its own
            own_rope = RotaryEmbedding(RopeConfig(theta=theta, scaling=c.rope.scaling), c.head_dim)
        self.attention_norm = RMSNorm(c.dim, eps=c.norm_eps, offset=1.0)
        self.attention = GatedAttention(
            dim=c.dim,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            norm_eps=c.norm_eps,
            qk_scale=c.qk_scale_factor,
            window=c.layer_window(layer),
            rotary=bool(theta),
            own_rope=own_rope,
        )
        self.post_norm_eps = c.post_norm_eps  # post_attn_norm: scaleless, no module
        self.attention_residual = ResidualGate(c.dim, temperature=c.residual_gate_temperature)
        self.ffn_norm = RMSNorm(c.dim, eps=c.norm_eps, offset=1.0)
        if c.is_dense(layer):
            self.feed_forward: nn.Module = FeedForward(dim=c.dim, hidden_dim=c.ffn_hidden_dim)
        else:
            self.feed_forward = PooledMoE(
                dim=c.dim,
                pooled_dim=c.moe_dim,
                hidden_dim=c.moe_hidden_dim,
                router=router_config(c),
                router_scale=c.output_multiplier,
                norm_eps=c.norm_eps,
                post_norm_eps=c.post_norm_eps,
            )
        self.post_ffn_norm = InputScaledRMSNorm(c.dim, eps=c.post_norm_eps)
        self.ffn_residual = ResidualGate(c.dim, temperature=c.residual_gate_temperature)

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        a_BSD = self.attention(self.attention_norm(x_BSD), rope, meta, kv_cache)
        x_BSD = self.attention_residual(x_BSD, unit_rms(a_BSD, eps=self.post_norm_eps))
        f_BSD = self.post_ffn_norm(self.feed_forward(self.ffn_norm(x_BSD)))
        return self.ffn_residual(x_BSD, f_BSD)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits: dict[str, Init] = {}
        for name in (
            "attention_norm",
            "attention",
            "attention_residual",
            "ffn_norm",
            "feed_forward",
            "post_ffn_norm",
            "ffn_residual",
        ):
            inits |= prefixed(name, getattr(self, name).param_init(std=std, out_std=out_std))
        return inits


def media_towers(config: MuseSparkConfig) -> dict[str, nn.Module]:
    """The towers ``config`` has, by attribute name: ``visual`` (vision tower and adapter)
    and ``audio``, built on the current default device."""
    towers: dict[str, nn.Module] = {}
    if config.vision is not None:
        towers["visual"] = MuseGlimmerVisionTower(
            config.vision,
            out_dim=config.dim,
            projector_dim=config.projector_hidden_dim,
            norm_eps=config.norm_eps,
        )
    if config.audio is not None:
        towers["audio"] = MuseSparkAudioTower(config.audio, out_dim=config.dim)
    return towers


class MuseSpark(Transformer):
    """Muse Spark Open: the causal LM, plus ``visual`` (the vision tower and adapter) and
    ``audio`` (the audio tower) when the config has them."""

    def __init__(self, config: MuseSparkConfig) -> None:
        towers: dict[str, nn.Module | None] = dict(media_towers(config))
        self.visual: MuseGlimmerVisionTower | None
        self.audio: MuseSparkAudioTower | None
        blocks = [MuseSparkBlock(config, i) for i in range(config.num_layers)]
        super().__init__(config, blocks, extra_modules=towers)
        on_meta = self.tok_embeddings is not None and self.tok_embeddings.weight.is_meta
        device = "meta" if on_meta else None
        self.output = SoftCappedLinear(
            config.dim,
            config.vocab_size,
            multiplier=config.output_multiplier,
            cap=config.logit_softcap,
            device=device,
        )
        self._tie()
        if not on_meta:
            self.init_weights()

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        image_index: torch.Tensor | None = None,
        audio_values: torch.Tensor | None = None,
        audio_lengths: torch.Tensor | None = None,
        audio_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        input_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Soft-capped logits ``(B, S, V)`` for token ids ``(B, S)``, with images and audio
        clips at their placeholders.

        Args:
            pixel_values: ``(patches, T·C·P·P)`` of every image of the batch, images in
                placeholder order, each image's patches row by row (Muse Glimmer's layout).
            image_grid_thw: ``(images, 3)`` patch grid ``(t, h, w)`` of each image (host ints
                or a tensor, read on the host).
            image_index: ``(T,)`` flat indices in ``B·S`` of the image placeholders; by
                default found in ``tokens`` (one host read).
            audio_values: ``(clips, samples)`` mono waveforms in placeholder order, each
                right-padded to a multiple of ``audio.samples_per_token``.
            audio_lengths: ``(clips,)`` real samples of each clip (``None``: all of them);
                a clip has ``⌈length / samples_per_token⌉`` placeholders.
            audio_index: flat indices of the audio placeholders (by default found in
                ``tokens``).
            positions, document_ids, kv_cache, input_lengths: as ``Transformer.forward``; a
                step into a KV cache may carry media too (positions stay 1-D, so nothing
                about them outlives the step).
        """
        h_BSD, _ = self.run_blocks(
            tokens,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            image_index=image_index,
            audio_values=audio_values,
            audio_lengths=audio_lengths,
            audio_index=audio_index,
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
        audio_values: torch.Tensor | None = None,
        audio_lengths: torch.Tensor | None = None,
        audio_index: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
        **inputs: Any,
    ) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]]:
        """``Transformer.run_blocks`` on the token embeddings normalised without a scale
        (outside the embedding module, so a vocabulary-parallel embedding normalises whole
        rows), the media tokens scattered in at their placeholders. ``embeddings``: the
        blocks' input made elsewhere (then nothing is embedded here)."""
        grids = grid_list(image_grid_thw)
        if pixel_values is None and grids:
            raise ValueError("image_grid_thw given without pixel_values")
        if audio_values is None and audio_lengths is not None:
            raise ValueError("audio_lengths given without audio_values")
        media = pixel_values is not None or audio_values is not None
        if embeddings is None and self.tok_embeddings is not None:
            embeddings = self._embed(tokens)
        if media and (embeddings is None or self.tok_embeddings is None):
            raise ValueError(
                "pixel_values / audio_values given to a model part without the embedding"
            )
        if media and self.context_parallel is not None:
            raise ValueError(
                "pixel_values / audio_values cannot be combined with context parallelism yet"
            )
        if pixel_values is not None:
            assert embeddings is not None
            embeddings = self._scatter_images(embeddings, tokens, pixel_values, grids, image_index)
        if audio_values is not None:
            assert embeddings is not None
            embeddings = self._scatter_audio(
                embeddings, tokens, audio_values, audio_lengths, audio_index
            )
        return super().run_blocks(tokens, embeddings=embeddings, **inputs)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normed token embeddings; media placeholders embed as token 0 (as transformers':
        a placeholder id may lie past the vocabulary), their rows replaced afterwards."""
        assert self.tok_embeddings is not None
        c = cast(MuseSparkConfig, self.config)
        media = (
            (tokens == c.image_token_id)
            | (tokens == c.video_token_id)
            | (tokens == c.audio_token_id)
        )
        return unit_rms(self.tok_embeddings(tokens.masked_fill(media, 0)), eps=c.norm_eps)

    def _scatter_images(
        self,
        h_BSD: torch.Tensor,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor,
        grids: list[tuple],
        image_index: torch.Tensor | None,
    ) -> torch.Tensor:
        c = cast(MuseSparkConfig, self.config)
        visual = self.visual if "visual" in self._modules else None
        if visual is None:
            raise ValueError("pixel_values given to a model without the vision tower")
        if not grids:
            raise ValueError("pixel_values need image_grid_thw (the patch grid of each image)")
        features_TD = visual(pixel_values, grids, backend=c.attention_backend)
        if image_index is None:
            image_index = placeholder_index(tokens, c.image_token_id)
        check_placeholders(image_index, features_TD.shape[0])
        return scatter(h_BSD, image_index, features_TD)

    def _scatter_audio(
        self,
        h_BSD: torch.Tensor,
        tokens: torch.Tensor,
        audio_AN: torch.Tensor,
        lengths_A: torch.Tensor | None,
        audio_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """The audio tower's tokens of each clip's real samples, normalised without a scale
        (the embedding's norm, as transformers), at the audio placeholders."""
        c = cast(MuseSparkConfig, self.config)
        audio = self.audio if "audio" in self._modules else None
        if audio is None or c.audio is None:
            raise ValueError("audio_values given to a model without the audio tower")
        out_ATD = audio(audio_AN)
        if lengths_A is None:
            features_TD = out_ATD.reshape(-1, out_ATD.shape[-1])
        else:
            if lengths_A.shape != (audio_AN.shape[0],):
                raise ValueError(
                    f"audio_lengths must be ({audio_AN.shape[0]},): one length per clip, got "
                    f"{tuple(lengths_A.shape)}"
                )
            keep_AT = audio_token_mask(out_ATD.shape[1], lengths_A, c.audio.samples_per_token)
            features_TD = out_ATD[keep_AT]
        features_TD = unit_rms(features_TD, eps=c.norm_eps)
        if audio_index is None:
            audio_index = placeholder_index(tokens, c.audio_token_id)
        check_placeholders(audio_index, features_TD.shape[0], what="audio")
        return scatter(h_BSD, audio_index, features_TD)

    def _extra_param_inits(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits: dict[str, Init] = {}
        for name in ("visual", "audio"):
            tower = self._modules.get(name)
            if tower is not None:
                inits |= prefixed(name, cast(Any, tower).param_init(std=std, out_std=out_std))
        return inits


__all__ = ["MuseSpark", "MuseSparkBlock", "router_config"]
