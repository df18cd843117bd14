"""Kimi Linear (Kimi Team, 2025): Kimi Delta Attention and NoPE MLA layers, DeepSeek-V3 MoE.

Single-device code: parallelism (experts included) is applied from outside, from ``plan.py``.
The forward pass is ``components.Transformer.forward``; a block is ``TransformerBlock`` whose
token mixer is, per ``layer_types``, ``components.linear_attention.KimiDeltaAttention`` (the
gated delta rule with one decay per key channel) or ``components.mla`` without rotary
embeddings, and whose feed-forward is a SwiGLU (the ``dense`` layers of ``mlp_layer_types``) or ``dist_moe.MoE``
with shared experts and DeepSeek-V3's sigmoid routing. A KV cache holds the MLA latents for
the MLA layers and a fixed-size state for the KDA layers.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from ..components import FeedForward, Transformer, TransformerBlock
from ..components.linear_attention import KimiDeltaAttention
from ..components.mla import MultiHeadLatentAttention
from ..components.moe import MoEFeedForward
from ..deepseek_v3.model import router_config, softmax_scale
from .config import KimiLinearConfig


def token_mixer(config: KimiLinearConfig, layer: int) -> nn.Module:
    """KDA or NoPE MLA, as ``layer_types`` says for ``layer``."""
    c = config
    if c.is_linear(layer):
        return KimiDeltaAttention(
            dim=c.dim,
            num_heads=c.linear_num_heads,
            head_dim=c.linear_head_dim,
            conv_kernel_size=c.linear_conv_kernel_dim,
            norm_eps=c.norm_eps,
            chunk_size=c.chunk_size,
            backend=c.linear_attention_backend,
        )
    return MultiHeadLatentAttention(
        dim=c.dim,
        num_heads=c.num_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        latent_norm_eps=c.latent_norm_eps,
        softmax_scale=softmax_scale(c),
        rotary=False,
    )


class KimiLinear(Transformer):
    """Kimi Linear causal LM."""

    def __init__(self, config: KimiLinearConfig) -> None:
        c = config
        blocks = []
        for i in range(c.num_layers):
            if c.is_dense(i):
                feed_forward: nn.Module = FeedForward(dim=c.dim, hidden_dim=c.ffn_hidden_dim)
            else:
                feed_forward = MoEFeedForward(
                    dim=c.dim,
                    hidden_dim=c.moe_hidden_dim,
                    router=router_config(c),
                    shared_hidden_dim=c.num_shared_experts * c.moe_hidden_dim,
                )
            blocks.append(
                TransformerBlock(
                    dim=c.dim,
                    norm_eps=c.norm_eps,
                    attention=token_mixer(c, i),
                    feed_forward=feed_forward,
                )
            )
        super().__init__(config, blocks)

    def kv_cache_widths(self) -> tuple[int, int, int]:
        """MLA layers cache a latent per token (``kv_lora_rank``) and the shared key part
        (``qk_rope_head_dim``); KDA layers a fixed-size state."""
        config = cast(KimiLinearConfig, self.config)
        return 1, config.kv_lora_rank, config.qk_rope_head_dim


__all__ = ["KimiLinear", "token_mixer"]
