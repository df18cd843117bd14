"""Qwen3.5 dense configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig
from ..components.linear_attention.layer_types import (
    check_linear_attention_fields,
    delta_rule_flops,
    resolved_layer_types,
)


@dataclass(kw_only=True, slots=True)
class Qwen3_5Config(TransformerConfig):
    """Qwen3.5 text decoder: each block is gated attention (GQA, zero-centred QK-norm, partial
    RoPE, sigmoid output gate) or Gated DeltaNet, per ``layer_types``, then a SwiGLU; every
    RMSNorm of the residual stream is zero-centred (scale = 1 + weight).

    ``num_heads`` / ``num_kv_heads`` / ``head_dim`` describe the attention layers, the
    ``linear_*`` fields the Gated DeltaNet layers.
    """

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the QK-norms and the gated output norms included."""
    partial_rotary_factor: float = 0.25
    """Fraction of a query/key head that RoPE rotates (the leading channels)."""
    layer_types: tuple[str, ...] = ()
    """``full_attention`` or ``linear_attention`` per layer; empty: every
    ``full_attention_interval``-th layer is attention, the others Gated DeltaNet."""
    full_attention_interval: int = 4
    """Period of the attention layers when ``layer_types`` is empty (HF's default pattern)."""
    linear_num_key_heads: int
    """Query/key heads of a Gated DeltaNet layer."""
    linear_num_value_heads: int
    """Value heads (and recurrent states) of a Gated DeltaNet layer; a multiple of the key heads."""
    linear_key_head_dim: int
    """Width of a Gated DeltaNet query/key head."""
    linear_value_head_dim: int
    """Width of a Gated DeltaNet value head."""
    linear_conv_kernel_dim: int = 4
    """Taps of the short causal convolution on q, k and v."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule (a power of two)."""
    linear_attention_backend: str = "torch"
    """Chunked delta-rule implementation: ``torch`` (any device), ``triton`` or ``auto`` (Triton
    on CUDA). Torch by default until the Triton kernels have passed their CUDA test."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        check_linear_attention_fields(
            self,
            heads=("linear_num_key_heads", "linear_num_value_heads"),
            dims=("linear_key_head_dim", "linear_value_head_dim"),
        )
        name = type(self).__name__
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"{name}.linear_num_value_heads={self.linear_num_value_heads} must be a multiple "
                f"of linear_num_key_heads={self.linear_num_key_heads}"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"{name}.partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1] "
                f"and give an even rotary width of head_dim={self.head_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        """The rotated leading channels of an attention head."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def norm_offset(self) -> float:
        """Zero-centred RMSNorm weights (HF ``Qwen3_5RMSNorm``: ``x̂ · (1 + w)``)."""
        return 1.0

    def is_linear(self, layer: int) -> bool:
        """Whether block ``layer`` is a Gated DeltaNet layer."""
        return resolved_layer_types(self)[layer] == "linear_attention"

    def linear_attention_params(self) -> int:
        """Matmul weights of one Gated DeltaNet layer (the conv filters count: one multiply-add
        per tap per token, like a matmul weight)."""
        c = self
        qk = c.linear_num_key_heads * c.linear_key_head_dim
        vv = c.linear_num_value_heads * c.linear_value_head_dim
        projections = c.dim * (2 * qk + 2 * vv + 2 * c.linear_num_value_heads) + vv * c.dim
        return projections + (2 * qk + vv) * c.linear_conv_kernel_dim

    def attention_params(self) -> int:
        """Matmul weights of one gated-attention layer (``wq`` yields the gate too)."""
        c = self
        return c.dim * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim + (
            c.num_heads * c.head_dim * c.dim
        )

    def ffn_params(self) -> int:
        """Active matmul weights of one block's feed-forward."""
        return 3 * self.dim * self.ffn_hidden_dim

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (see ``titan_models.matmul_params``)."""
        linear = sum(self.is_linear(i) for i in range(self.num_layers))
        mixers = linear * self.linear_attention_params()
        mixers += (self.num_layers - linear) * self.attention_params()
        return mixers + self.num_layers * self.ffn_params() + self.dim * self.vocab_size

    def attention_flops(self, seq_len: int) -> int:
        """Softmax attention ``12·L_attn·H·E·T`` plus the chunked delta rule of the linear
        layers (``delta_rule_flops``: its matmuls, forward + backward, independent of T)."""
        linear = sum(self.is_linear(i) for i in range(self.num_layers))
        softmax = 12 * (self.num_layers - linear) * self.num_heads * self.head_dim * seq_len
        return softmax + linear * delta_rule_flops(
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
            self.chunk_size,
        )


_VOCAB = 248_320
_CONTEXT = 262_144
_ROPE = RopeConfig(theta=10_000_000.0)

QWEN3_5_FLAVORS: dict[str, Qwen3_5Config] = {
    # Tiny: Gated DeltaNet and attention alternating (4 layers; any num_layers override keeps
    # the pattern); 2 key heads shared by 4 value heads, as the real models share them.
    "debug": Qwen3_5Config(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=256,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rope=_ROPE,
        max_seq_len=2048,
    ),
    # Qwen/Qwen3.5-27B (text decoder; 16 x (3 Gated DeltaNet + 1 gated attention))
    "27B": Qwen3_5Config(
        vocab_size=_VOCAB,
        dim=5120,
        num_layers=64,
        num_heads=24,
        num_kv_heads=4,
        head_dim=256,
        ffn_hidden_dim=17408,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        rope=_ROPE,
        max_seq_len=_CONTEXT,
    ),
}
