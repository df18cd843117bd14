"""Kimi Linear configuration and flavours (hyper-parameters of the public HF checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig
from ..components.linear_attention.layer_types import (
    check_linear_attention_fields,
    delta_rule_flops,
    resolved_layer_types,
)
from ..deepseek_v3.config import DeepSeekV3Config

_NO_ROPE = RopeConfig(theta=10_000.0)


@dataclass(kw_only=True, slots=True)
class KimiLinearConfig(DeepSeekV3Config):
    """Kimi Linear: the DeepSeek-V3 (Moonlight) stack with most MLA layers replaced by Kimi Delta
    Attention (``layer_types``); MLA without positional encoding (NoPE), so ``rope`` is unused;
    a SwiGLU or a MoE block (shared experts, sigmoid routing) per layer: ``mlp_layer_types``,
    in any order, or by default ``first_k_dense`` SwiGLU blocks and then MoE blocks.
    No multi-token prediction.

    ``num_heads`` … ``v_head_dim`` describe the MLA layers, the ``linear_*`` fields the KDA
    layers (as many query/key heads as value heads, one head width).
    """

    norm_eps: float = 1e-5
    """Epsilon of the block and final RMSNorms and of KDA's gated output norm."""
    rope: RopeConfig = _NO_ROPE
    """Unused: Kimi Linear's MLA carries no positions (kept for the shared config shape)."""
    layer_types: tuple[str, ...] = ()
    """``full_attention`` (MLA) or ``linear_attention`` (KDA) per layer; empty: every
    ``full_attention_interval``-th layer is MLA."""
    mlp_layer_types: tuple[str, ...] = ()
    """``dense`` (SwiGLU of ``ffn_hidden_dim``) or ``sparse`` (MoE) per layer, in any order;
    empty: the first ``first_k_dense`` layers dense, the rest sparse (then ``first_k_dense``
    is what decides; with the list it is unused)."""
    full_attention_interval: int = 4
    """Period of the MLA layers when ``layer_types`` is empty."""
    linear_num_heads: int
    """Heads of a KDA layer."""
    linear_head_dim: int
    """Width of a KDA head (query, key and value)."""
    linear_conv_kernel_dim: int = 4
    """Taps of the short causal convolution on q, k and v."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule (a power of two)."""
    linear_attention_backend: str = "torch"
    """Chunked delta-rule implementation: ``torch`` (any device), ``triton`` or ``auto`` (Triton
    on CUDA). Torch by default until the Triton kernels have passed their CUDA test."""

    def __post_init__(self) -> None:
        DeepSeekV3Config.__post_init__(self)
        check_linear_attention_fields(self, heads=("linear_num_heads",), dims=("linear_head_dim",))
        self.mlp_layer_types = tuple(self.mlp_layer_types)
        kinds = self.mlp_layer_types
        if kinds and (
            len(kinds) != self.num_layers or any(k not in ("dense", "sparse") for k in kinds)
        ):
            raise ValueError(
                f"{type(self).__name__}.mlp_layer_types={list(kinds)} must name 'dense' or "
                f"'sparse' for each of the num_layers={self.num_layers} layers (or be empty)"
            )
        if self.num_mtp_modules:
            raise ValueError(
                f"{type(self).__name__}.num_mtp_modules must be 0 (Kimi Linear has no "
                f"multi-token prediction), got {self.num_mtp_modules}"
            )

    def is_dense(self, layer: int) -> bool:
        """Whether block ``layer`` has a dense SwiGLU (else a MoE)."""
        if self.mlp_layer_types:
            return self.mlp_layer_types[layer] == "dense"
        return layer < self.first_k_dense

    def is_linear(self, layer: int) -> bool:
        """Whether block ``layer`` is a KDA layer."""
        return resolved_layer_types(self)[layer] == "linear_attention"

    def linear_attention_params(self) -> int:
        """Matmul weights of one KDA layer (conv filters included)."""
        c, H, K = self, self.linear_num_heads, self.linear_head_dim
        projections = 3 * c.dim * H * K + 3 * H * K * c.linear_conv_kernel_dim
        gates = 2 * (c.dim * K + K * H * K) + c.dim * H  # decay, output gate, beta
        return projections + gates + H * K * c.dim

    def matmul_params(self) -> int:
        """Active weights: MLA or KDA per layer, dense or (router + top-k + shared) FFNs, head."""
        c = self
        linear = sum(c.is_linear(i) for i in range(c.num_layers))
        moe = c.dim * c.num_experts
        moe += (c.num_experts_per_tok + c.num_shared_experts) * 3 * c.dim * c.moe_hidden_dim
        dense = 3 * c.dim * c.ffn_hidden_dim
        mixers = linear * c.linear_attention_params()
        mixers += (c.num_layers - linear) * c.attention_params()
        dense_layers = sum(c.is_dense(i) for i in range(c.num_layers))
        ffns = dense_layers * dense + (c.num_layers - dense_layers) * moe
        return mixers + ffns + c.dim * c.vocab_size

    def attention_flops(self, seq_len: int) -> int:
        """MLA ``6·L_mla·H·(E_qk + E_v)·T`` plus the chunked delta rule of the KDA layers."""
        linear = sum(self.is_linear(i) for i in range(self.num_layers))
        mla = 6 * (self.num_layers - linear) * self.num_heads * (self.head_dim + self.v_head_dim)
        return mla * seq_len + linear * delta_rule_flops(
            self.linear_num_heads, self.linear_head_dim, self.linear_head_dim, self.chunk_size
        )


KIMI_LINEAR_FLAVORS: dict[str, KimiLinearConfig] = {
    # Tiny: KDA and MLA alternating (4 layers), one dense block, 8 experts top-2 + 1 shared.
    "debug": KimiLinearConfig(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=48,
        ffn_hidden_dim=256,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        first_k_dense=1,
        route_scale=2.446,
        full_attention_interval=2,
        linear_num_heads=4,
        linear_head_dim=32,
        max_seq_len=2048,
    ),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct (3 KDA : 1 MLA; MLA at HF layers 4, 8, ..., 24, 27)
    "48B-A3B": KimiLinearConfig(
        vocab_size=163_840,
        dim=2304,
        num_layers=27,
        num_heads=32,
        num_kv_heads=32,
        head_dim=192,
        ffn_hidden_dim=9216,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_hidden_dim=1024,
        num_shared_experts=1,
        first_k_dense=1,
        route_scale=2.446,
        layer_types=tuple(
            "full_attention" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "linear_attention"
            for i in range(27)
        ),
        linear_num_heads=32,
        linear_head_dim=128,
        max_seq_len=1_048_576,
    ),
}
