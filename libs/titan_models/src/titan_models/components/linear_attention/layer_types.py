"""What the hybrid families (Qwen3.5, Kimi Linear) share about their layer pattern: which
blocks are linear attention, field validation, and the FLOPs of the chunked delta rule."""

from __future__ import annotations

from typing import Any

from .delta_rule import DELTA_RULE_BACKENDS

LAYER_TYPES = ("full_attention", "linear_attention")
"""The token mixers a hybrid layer may have (HF ``layer_types`` values)."""


def delta_rule_flops(heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """Forward + backward FLOPs per token of ``chunk_delta_rule`` for one layer: per chunk and
    head the matmuls ``A_kk``, ``A_qk`` (2C²K each), the unit-triangular solve (C²(K + V)),
    ``w S``, ``q S`` and ``k^T v_new`` (2CKV each) and ``A_qk v_new`` (2C²V); ×3 for the
    backward, as for every matmul in ``6·N``."""
    C, K, V = chunk, key_dim, value_dim
    return 3 * heads * (C * (5 * K + 3 * V) + 6 * K * V)


def resolved_layer_types(config: Any) -> tuple[str, ...]:
    """``config.layer_types``, or HF's default pattern (attention every
    ``full_attention_interval`` layers, the last of each period) when empty."""
    if config.layer_types:
        return tuple(config.layer_types)
    n = config.full_attention_interval
    return tuple(
        "full_attention" if (i + 1) % n == 0 else "linear_attention"
        for i in range(config.num_layers)
    )


def check_linear_attention_fields(
    config: Any, *, heads: tuple[str, ...], dims: tuple[str, ...]
) -> None:
    """``ValueError`` naming the first out-of-range linear-attention field of a hybrid config."""
    name = type(config).__name__
    for field in (*heads, *dims, "linear_conv_kernel_dim", "chunk_size"):
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
    if config.chunk_size & (config.chunk_size - 1):
        raise ValueError(f"{name}.chunk_size must be a power of two, got {config.chunk_size}")
    if config.linear_attention_backend not in DELTA_RULE_BACKENDS:
        raise ValueError(
            f"{name}.linear_attention_backend must be one of {DELTA_RULE_BACKENDS}, "
            f"got {config.linear_attention_backend!r}"
        )
    interval = getattr(config, "full_attention_interval", 1)
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"{name}.full_attention_interval must be an int >= 1, got {interval!r}")
    types = tuple(config.layer_types)
    if types and len(types) != config.num_layers:
        raise ValueError(
            f"{name}.layer_types has {len(types)} entries, num_layers={config.num_layers}"
        )
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{name}.layer_types contains {unknown}; allowed: {list(LAYER_TYPES)}")
    config.layer_types = types
