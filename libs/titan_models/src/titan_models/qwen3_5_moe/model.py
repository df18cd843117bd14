"""Qwen3.5-MoE (Qwen Team, 2026): the Qwen3.5 hybrid stack with a routed MoE in every block.

Single-device code: parallelism (experts included) is applied from outside, from ``plan.py``.
Token mixers as ``qwen3_5``; the feed-forward is ``dist_moe.MoE``: softmax over all experts,
top-k, always renormalised, gate matmul in the model dtype (as HF), plus one shared SwiGLU
expert scaled by a per-token sigmoid gate.
"""

from __future__ import annotations

from dist_moe import RouterConfig

from ..components import Transformer
from ..components.moe import MoEFeedForward
from ..qwen3_5.model import hybrid_blocks
from .config import Qwen3_5MoeConfig


def router_config(config: Qwen3_5MoeConfig) -> RouterConfig:
    """dist_moe routing that reproduces HF ``Qwen3_5MoeTopKRouter``."""
    return RouterConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        score_func="softmax",
        norm_topk_prob=True,
        seq_aux_loss_coef=config.aux_loss_coef,
        logits_dtype=None,  # HF computes the gate in the model dtype, softmax in fp32
    )


class Qwen3_5Moe(Transformer):
    """Qwen3.5-MoE causal LM (the text decoder of the published checkpoints)."""

    def __init__(self, config: Qwen3_5MoeConfig) -> None:
        def moe(_: int) -> MoEFeedForward:
            return MoEFeedForward(
                dim=config.dim,
                hidden_dim=config.moe_hidden_dim,
                router=router_config(config),
                shared_hidden_dim=config.ffn_hidden_dim,
                shared_gate=True,
            )

        super().__init__(config, hybrid_blocks(config, moe))


__all__ = ["Qwen3_5Moe", "router_config"]
