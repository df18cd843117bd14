"""Qwen3.5-MoE configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig
from ..components.moe import check_moe_fields
from ..qwen3_5.config import Qwen3_5Config


@dataclass(kw_only=True, slots=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Qwen3.5-MoE: the Qwen3.5 hybrid stack with a routed MoE (softmax top-k, renormalised)
    plus a sigmoid-gated shared expert in every block.

    ``ffn_hidden_dim`` is the shared expert's hidden width (HF
    ``shared_expert_intermediate_size``); there is no dense SwiGLU.
    """

    num_experts: int
    """Routed experts per MoE layer."""
    num_experts_per_tok: int
    """Experts each token is routed to (top-k)."""
    moe_hidden_dim: int
    """Hidden width of one routed expert (HF ``moe_intermediate_size``)."""
    aux_loss_coef: float = 0.001
    """Weight of dist_moe's sequence-wise balance loss, attached through autograd in training
    (0: none). HF's ``router_aux_loss_coef`` weighs a batch-wise Switch loss instead."""

    def __post_init__(self) -> None:
        Qwen3_5Config.__post_init__(self)
        check_moe_fields(self)

    def ffn_params(self) -> int:
        """Active matmul weights of one MoE block: router, ``top_k`` routed experts, the shared
        expert and its gate."""
        c = self
        routed = c.num_experts_per_tok * 3 * c.dim * c.moe_hidden_dim
        return c.dim * c.num_experts + routed + 3 * c.dim * c.ffn_hidden_dim + c.dim


QWEN3_5_MOE_FLAVORS: dict[str, Qwen3_5MoeConfig] = {
    # Tiny: Gated DeltaNet and attention alternating, 8 experts top-2 and a shared expert.
    "debug": Qwen3_5MoeConfig(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=64,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        rope=RopeConfig(theta=10_000_000.0),
        max_seq_len=2048,
    ),
    # Qwen/Qwen3.5-35B-A3B (text decoder; 10 x (3 Gated DeltaNet + 1 gated attention), each
    # block 256 experts top-8 + 1 shared)
    "35B-A3B": Qwen3_5MoeConfig(
        vocab_size=248_320,
        dim=2048,
        num_layers=40,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        ffn_hidden_dim=512,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_hidden_dim=512,
        rope=RopeConfig(theta=10_000_000.0),
        max_seq_len=262_144,
    ),
}
