"""Qwen3-MoE (Qwen Team, 2025): the Qwen3 block with its MLP replaced by a routed MoE.

Single-device code: parallelism (experts included) is applied from outside, from ``plan.py``.
The forward pass is ``components.Transformer.forward``; the attention is the Qwen3 one
(``components.Attention`` with QK-norm) and the MoE is ``dist_moe.MoE``: softmax over all
experts, top-k, renormalised when ``norm_topk_prob`` (as HF), gate matmul in the model dtype.
"""

from __future__ import annotations

from dist_moe import RouterConfig

from ..components import Transformer, TransformerBlock, gqa_attention
from ..components.moe import MoEFeedForward
from .config import Qwen3MoeConfig


def router_config(config: Qwen3MoeConfig) -> RouterConfig:
    """dist_moe routing that reproduces HF ``Qwen3MoeTopKRouter``."""
    return RouterConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        score_func="softmax",
        norm_topk_prob=config.norm_topk_prob,
        seq_aux_loss_coef=config.aux_loss_coef,
        logits_dtype=None,  # HF computes the gate in the model dtype, softmax in fp32
    )


class Qwen3Moe(Transformer):
    """Qwen3-MoE causal LM: QK-norm GQA attention + a routed SwiGLU MoE in every block."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        blocks = [
            TransformerBlock(
                dim=config.dim,
                norm_eps=config.norm_eps,
                attention=gqa_attention(config, qk_norm=True, layer=i),
                feed_forward=MoEFeedForward(
                    dim=config.dim, hidden_dim=config.moe_hidden_dim, router=router_config(config)
                ),
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, blocks)
