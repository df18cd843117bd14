"""Qwen3 dense (Qwen Team, 2025): the Llama block plus per-head RMSNorm on q and k.

Single-device code: parallelism is applied from outside, from ``plan.py``. The forward pass is
``components.Transformer.forward``; the block is ``components.TransformerBlock``.
"""

from __future__ import annotations

from ..components import Transformer, dense_blocks
from .config import Qwen3Config


class Qwen3(Transformer):
    """Qwen3 dense causal LM: the Llama 3 stack with RMSNorm on each q and k head before RoPE."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, dense_blocks(config, qk_norm=True))
