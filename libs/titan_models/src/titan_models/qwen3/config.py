"""Qwen3 dense configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig


@dataclass(kw_only=True, slots=True)
class Qwen3Config(TransformerConfig):
    """Qwen3 dense decoder: Llama-style GQA + SwiGLU with per-head RMSNorm on q and k."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the QK-norms included."""


_VOCAB = 151_936
_CONTEXT = 40_960
_ROPE = RopeConfig(theta=1_000_000.0)


def _flavor(**kw) -> Qwen3Config:
    return Qwen3Config(vocab_size=_VOCAB, max_seq_len=_CONTEXT, head_dim=128, rope=_ROPE, **kw)


QWEN3_FLAVORS: dict[str, Qwen3Config] = {
    # Tiny: trains in seconds on a CPU; heads * head_dim != dim as in the real 0.6B.
    "debug": Qwen3Config(
        vocab_size=2048,
        dim=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        ffn_hidden_dim=768,
        rope=_ROPE,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-0.6B
    "0.6B": _flavor(
        dim=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_dim=3072,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-1.7B
    "1.7B": _flavor(
        dim=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_dim=6144,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-4B
    "4B": _flavor(
        dim=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_dim=9728,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-8B
    "8B": _flavor(dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_hidden_dim=12288),
    # Qwen/Qwen3-14B
    "14B": _flavor(dim=5120, num_layers=40, num_heads=40, num_kv_heads=8, ffn_hidden_dim=17408),
    # Qwen/Qwen3-32B
    "32B": _flavor(dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, ffn_hidden_dim=25600),
}
