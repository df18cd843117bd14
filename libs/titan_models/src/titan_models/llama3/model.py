"""Llama 3 (Grattafiori et al., 2024): pre-norm GQA + SwiGLU decoder, Llama 3.1 RoPE scaling.

Single-device code: parallelism is applied from outside, from ``plan.py``. The forward pass is
``components.Transformer.forward``; the block is ``components.TransformerBlock``.
"""

from __future__ import annotations

from ..components import Transformer, dense_blocks
from .config import Llama3Config


class Llama3(Transformer):
    """Llama 3.x causal LM: embedding → [RMSNorm → GQA, RMSNorm → SwiGLU] × L → RMSNorm → head."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__(config, dense_blocks(config, qk_norm=False))
