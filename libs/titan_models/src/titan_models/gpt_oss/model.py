"""gpt-oss (OpenAI, 2025): GQA attention with biases and learned sinks, alternating
sliding-window / full layers, and a routed MoE of biased, clamped-SwiGLU experts.

Single-device code: parallelism is applied from outside, from ``plan.py``. The forward pass is
``components.Transformer.forward``; attention is ``components.Attention`` with ``bias`` and
``sinks`` through the ``attend`` interface (window per layer); the MoE is ``dist_moe.MoE``:
gate logits with a bias, softmax over the top-k of them (= the renormalised softmax of all),
experts ``(min(g, L) · σ(α·min(g, L))) · (clamp(u, ±L) + 1)`` with biases on every
projection.
"""

from __future__ import annotations

from dist_moe import RouterConfig, SwiGLU

from ..components import Attention, Transformer, TransformerBlock
from ..components.moe import MoEFeedForward
from .config import GptOssConfig


def router_config(config: GptOssConfig) -> RouterConfig:
    """dist_moe routing that reproduces HF ``GptOssTopKRouter``."""
    return RouterConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        score_func="softmax",
        norm_topk_prob=True,
        gate_bias=True,
        seq_aux_loss_coef=config.aux_loss_coef,
        logits_dtype=None,  # HF computes the gate in the model dtype
    )


def expert_activation(config: GptOssConfig) -> SwiGLU:
    """The experts' clamped SwiGLU."""
    return SwiGLU(limit=config.swiglu_limit, alpha=config.swiglu_alpha, up_offset=1.0)


class GptOss(Transformer):
    """gpt-oss causal LM."""

    def __init__(self, config: GptOssConfig) -> None:
        blocks = [
            TransformerBlock(
                dim=config.dim,
                norm_eps=config.norm_eps,
                attention=Attention(
                    dim=config.dim,
                    num_heads=config.num_heads,
                    num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim,
                    window=config.layer_window(i),
                    bias=True,
                    sinks=True,
                ),
                feed_forward=MoEFeedForward(
                    dim=config.dim,
                    hidden_dim=config.moe_hidden_dim,
                    router=router_config(config),
                    activation=expert_activation(config),
                    expert_bias=True,
                ),
            )
            for i in range(config.num_layers)
        ]
        super().__init__(config, blocks)


__all__ = ["GptOss", "expert_activation", "router_config"]
