"""Qwen3.5 (Qwen Team, 2026): a hybrid of Gated DeltaNet and gated attention layers.

Single-device code: parallelism is applied from outside, from ``plan.py``. The forward pass is
``components.Transformer.forward``; a block is ``components.TransformerBlock`` whose token mixer
is, per ``layer_types``, either

- ``components.Attention`` with a sigmoid output gate (``wq`` yields query and gate per head),
  zero-centred QK-norm and RoPE on the leading ``partial_rotary_factor`` of each head, or
- ``components.linear_attention.GatedDeltaNet`` (short conv, L2-normalised q/k, the gated delta
  rule chunked for training and recurrent for decoding, gated RMSNorm),

followed by a SwiGLU (a routed MoE in ``qwen3_5_moe``). A KV cache holds keys and values for the
attention layers and a fixed-size state for the Gated DeltaNet layers. Text only: with equal
positions for Qwen3.5's three M-RoPE sections, its rotary embedding is plain RoPE.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..components import Attention, FeedForward, Transformer, TransformerBlock
from ..components.linear_attention import GatedDeltaNet
from .config import Qwen3_5Config


def token_mixer(config: Qwen3_5Config, layer: int) -> nn.Module:
    """Gated DeltaNet or gated attention, as ``layer_types`` says for ``layer``."""
    c = config
    if c.is_linear(layer):
        return GatedDeltaNet(
            dim=c.dim,
            num_key_heads=c.linear_num_key_heads,
            num_value_heads=c.linear_num_value_heads,
            key_head_dim=c.linear_key_head_dim,
            value_head_dim=c.linear_value_head_dim,
            conv_kernel_size=c.linear_conv_kernel_dim,
            norm_eps=c.norm_eps,
            chunk_size=c.chunk_size,
            backend=c.linear_attention_backend,
        )
    return Attention(
        dim=c.dim,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        qk_norm_eps=c.norm_eps,
        qk_norm_offset=1.0,
        output_gate=True,
    )


def hybrid_blocks(
    config: Qwen3_5Config, feed_forward: Callable[[int], nn.Module]
) -> list[TransformerBlock]:
    """``num_layers`` blocks: the layer's token mixer, then ``feed_forward(layer)``."""
    return [
        TransformerBlock(
            dim=config.dim,
            norm_eps=config.norm_eps,
            norm_offset=config.norm_offset,
            attention=token_mixer(config, i),
            feed_forward=feed_forward(i),
        )
        for i in range(config.num_layers)
    ]


class Qwen3_5(Transformer):
    """Qwen3.5 dense causal LM (the text decoder of the published checkpoints)."""

    def __init__(self, config: Qwen3_5Config) -> None:
        blocks = hybrid_blocks(
            config, lambda _: FeedForward(dim=config.dim, hidden_dim=config.ffn_hidden_dim)
        )
        super().__init__(config, blocks)


__all__ = ["Qwen3_5", "hybrid_blocks", "token_mixer"]
