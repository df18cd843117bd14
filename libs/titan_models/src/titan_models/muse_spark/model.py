"""Muse Spark Open (text): the decoder of ``meta-models/Muse-Spark-Open-816B-A42B``.

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
  (``SoftCappedLinear``; the app's chunked loss applies the same cap per chunk).

Shapes: B batch, S sequence, D model dim.
"""

from __future__ import annotations

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


class MuseSpark(Transformer):
    """Muse Spark Open causal LM (text)."""

    def __init__(self, config: MuseSparkConfig) -> None:
        blocks = [MuseSparkBlock(config, i) for i in range(config.num_layers)]
        super().__init__(config, blocks)
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

    def run_blocks(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        input_lengths: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]]:
        """``Transformer.run_blocks`` with the embedding normalised (no scale) first. Outside
        the embedding module, so a vocabulary-parallel embedding normalises whole rows."""
        if embeddings is None and self.tok_embeddings is not None:
            embeddings = unit_rms(self.tok_embeddings(tokens), eps=self.config.norm_eps)
        return super().run_blocks(
            tokens,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
            embeddings=embeddings,
        )


__all__ = ["MuseSpark", "MuseSparkBlock", "router_config"]
