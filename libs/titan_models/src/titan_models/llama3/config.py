"""Llama 3 configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import Llama3RopeScaling, RopeConfig, TransformerConfig


@dataclass(kw_only=True, slots=True)
class Llama3Config(TransformerConfig):
    """Llama 3 / 3.1 / 3.2 dense decoder (GQA, SwiGLU, RMSNorm eps 1e-5, RoPE theta 5e5)."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""


_VOCAB = 128_256
_CONTEXT = 131_072  # Llama 3.1 / 3.2 context after the long-context extension
_ROPE_31 = RopeConfig(theta=500_000.0, scaling=Llama3RopeScaling(factor=8.0))
_ROPE_32 = RopeConfig(theta=500_000.0, scaling=Llama3RopeScaling(factor=32.0))


def _flavor(**kw) -> Llama3Config:
    return Llama3Config(vocab_size=_VOCAB, max_seq_len=_CONTEXT, **kw)


LLAMA3_FLAVORS: dict[str, Llama3Config] = {
    # Tiny: trains in seconds on a CPU; exercises GQA, head_dim != dim / heads and rope scaling.
    "debug": Llama3Config(
        vocab_size=2048,
        dim=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        ffn_hidden_dim=768,
        rope=RopeConfig(
            theta=500_000.0,
            scaling=Llama3RopeScaling(factor=8.0, original_max_seq_len=256),
        ),
        max_seq_len=2048,
    ),
    # meta-llama/Llama-3.2-1B
    "1B": _flavor(
        dim=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        ffn_hidden_dim=8192,
        rope=_ROPE_32,
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.2-3B
    "3B": _flavor(
        dim=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_dim=8192,
        rope=_ROPE_32,
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.1-8B
    "8B": _flavor(
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_dim=14336,
        rope=_ROPE_31,
    ),
    # meta-llama/Llama-3.1-70B
    "70B": _flavor(
        dim=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_dim=28672,
        rope=_ROPE_31,
    ),
    # meta-llama/Llama-3.1-405B
    "405B": _flavor(
        dim=16384,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_dim=53248,
        rope=_ROPE_31,
    ),
}
