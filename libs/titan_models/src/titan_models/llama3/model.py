"""Llama 3 (Grattafiori et al., 2024): pre-norm GQA + SwiGLU decoder, Llama 3.1 RoPE scaling.

Single-device code: parallelism is applied from outside, from ``plan.py``.
"""

from __future__ import annotations

from ..components import Attention, FeedForward, Transformer, TransformerBlock
from .config import Llama3Config


class Llama3(Transformer):
    """Llama 3.x causal LM; the forward pass is ``Transformer.forward``."""

    def __init__(self, config: Llama3Config) -> None:
        blocks = [
            TransformerBlock(
                dim=config.dim,
                norm_eps=config.norm_eps,
                attention=Attention(
                    dim=config.dim,
                    num_heads=config.num_heads,
                    num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim,
                ),
                feed_forward=FeedForward(dim=config.dim, hidden_dim=config.ffn_hidden_dim),
            )
            for _ in range(config.num_layers)
        ]
        super().__init__(config, blocks)
