"""Qwen3 dense (Qwen Team, 2025): the Llama block plus per-head RMSNorm on q and k.

Single-device code: parallelism is applied from outside, from ``plan.py``.
"""

from __future__ import annotations

from ..components import Attention, FeedForward, Transformer, TransformerBlock
from .config import Qwen3Config


class Qwen3(Transformer):
    """Qwen3 dense causal LM; the forward pass is ``Transformer.forward``."""

    def __init__(self, config: Qwen3Config) -> None:
        blocks = [
            TransformerBlock(
                dim=config.dim,
                norm_eps=config.norm_eps,
                attention=Attention(
                    dim=config.dim,
                    num_heads=config.num_heads,
                    num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim,
                    qk_norm_eps=config.norm_eps,
                ),
                feed_forward=FeedForward(dim=config.dim, hidden_dim=config.ffn_hidden_dim),
            )
            for _ in range(config.num_layers)
        ]
        super().__init__(config, blocks)
