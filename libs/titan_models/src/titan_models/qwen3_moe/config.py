"""Qwen3-MoE configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig
from ..components.moe import check_moe_fields


@dataclass(kw_only=True, slots=True)
class Qwen3MoeConfig(TransformerConfig):
    """Qwen3-MoE: the Qwen3 attention (GQA + QK-norm) with a routed SwiGLU MoE in every block.

    ``ffn_hidden_dim`` is HF's ``intermediate_size``: kept for the round trip, unused (every
    block is MoE; HF's ``mlp_only_layers`` / ``decoder_sparse_step`` are not modelled).
    """

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the QK-norms included."""
    num_experts: int
    """Routed experts per MoE layer."""
    num_experts_per_tok: int
    """Experts each token is routed to (top-k)."""
    moe_hidden_dim: int
    """Hidden width of one routed expert (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to one (HF ``norm_topk_prob``)."""
    aux_loss_coef: float = 0.001
    """Weight of dist_moe's sequence-wise balance loss, attached through autograd in training
    (0: none). HF's ``router_aux_loss_coef`` weighs a batch-wise Switch loss instead."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        check_moe_fields(self)

    def matmul_params(self) -> int:
        """Active weights: attention, router, ``top_k`` experts per layer, head."""
        c = self
        attention = c.dim * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        attention += c.num_heads * c.head_dim * c.dim
        moe = c.dim * c.num_experts + c.num_experts_per_tok * 3 * c.dim * c.moe_hidden_dim
        return c.num_layers * (attention + moe) + c.dim * c.vocab_size


_VOCAB = 151_936
_CONTEXT = 40_960
_ROPE = RopeConfig(theta=1_000_000.0)


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeConfig] = {
    # Tiny: a training step in well under a second on a CPU; 8 experts, top-2.
    "debug": Qwen3MoeConfig(
        vocab_size=2048,
        dim=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=384,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        rope=_ROPE,
        max_seq_len=2048,
    ),
    # Qwen/Qwen3-30B-A3B
    "30B-A3B": Qwen3MoeConfig(
        vocab_size=_VOCAB,
        dim=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_dim=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=768,
        rope=_ROPE,
        max_seq_len=_CONTEXT,
    ),
    # Qwen/Qwen3-235B-A22B
    "235B-A22B": Qwen3MoeConfig(
        vocab_size=_VOCAB,
        dim=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_dim=12288,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=1536,
        rope=_ROPE,
        max_seq_len=_CONTEXT,
    ),
}
