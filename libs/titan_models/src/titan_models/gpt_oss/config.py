"""gpt-oss configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig, YarnRopeScaling
from ..components.moe import check_moe_fields


@dataclass(kw_only=True, slots=True)
class GptOssConfig(TransformerConfig):
    """gpt-oss: GQA attention with biases and a learned sink per head, sliding-window and full
    layers alternating (``sliding_window`` / ``sliding_window_layers``), YaRN RoPE, and a
    routed MoE with biased experts and a clamped SwiGLU in every block.

    ``ffn_hidden_dim`` mirrors ``moe_hidden_dim`` (HF's one ``intermediate_size``); there is no
    dense MLP.
    """

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    num_experts: int
    """Routed experts per MoE layer (HF ``num_local_experts``)."""
    num_experts_per_tok: int
    """Experts per token (top-k)."""
    moe_hidden_dim: int
    """Hidden width of one expert (HF ``intermediate_size``)."""
    swiglu_alpha: float = 1.702
    """Gain of the experts' gate sigmoid: ``g · sigmoid(alpha · g)``."""
    swiglu_limit: float = 7.0
    """Clamp of the gate (from above) and the up projection (both sides)."""
    aux_loss_coef: float = 0.001
    """Weight of dist_moe's sequence-wise balance loss in training (0: none). HF's
    ``router_aux_loss_coef`` weighs a batch-wise Switch loss instead."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        check_moe_fields(self)
        name = type(self).__name__
        for field in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)!r}")

    def matmul_params(self) -> int:
        """Active weights: attention, router, ``top_k`` experts per layer, head (biases and
        sinks are negligible and left out)."""
        c = self
        attention = c.dim * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        attention += c.num_heads * c.head_dim * c.dim
        moe = c.dim * c.num_experts + c.num_experts_per_tok * 3 * c.dim * c.moe_hidden_dim
        return c.num_layers * (attention + moe) + c.dim * c.vocab_size

    def attention_flops(self, seq_len: int) -> int:
        """``12·H·E`` per attended key and layer: ``T`` keys in a full layer, ``min(W, T)`` in
        a sliding one (a windowed kernel executes no more); no causal discount."""
        keys = sum(
            min(w, seq_len) if (w := self.layer_window(i)) is not None else seq_len
            for i in range(self.num_layers)
        )
        return 12 * self.num_heads * self.head_dim * keys


_ROPE = RopeConfig(
    theta=150_000.0,
    scaling=YarnRopeScaling(
        factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, truncate=False
    ),
)


def _sliding_even(num_layers: int) -> tuple[int, ...]:
    """gpt-oss's schedule: layers 0, 2, 4, ... slide, the others attend to everything."""
    return tuple(range(0, num_layers, 2))


def _published(num_layers: int, num_experts: int) -> GptOssConfig:
    return GptOssConfig(
        vocab_size=201_088,
        dim=2880,
        num_layers=num_layers,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        ffn_hidden_dim=2880,
        num_experts=num_experts,
        num_experts_per_tok=4,
        moe_hidden_dim=2880,
        sliding_window=128,
        sliding_window_layers=_sliding_even(num_layers),
        rope=_ROPE,
        max_seq_len=131_072,
    )


GPT_OSS_FLAVORS: dict[str, GptOssConfig] = {
    # Tiny: alternating window-16 / full layers, 8 experts top-2, YaRN as published.
    "debug": GptOssConfig(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        sliding_window=16,
        sliding_window_layers=_sliding_even(4),
        rope=RopeConfig(
            theta=150_000.0,
            scaling=YarnRopeScaling(factor=4.0, original_max_seq_len=512, truncate=False),
        ),
        max_seq_len=2048,
    ),
    # openai/gpt-oss-20b
    "20B": _published(num_layers=24, num_experts=32),
    # openai/gpt-oss-120b
    "120B": _published(num_layers=36, num_experts=128),
}
