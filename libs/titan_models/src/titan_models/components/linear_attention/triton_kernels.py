"""Triton kernels of the chunked gated delta rule, forward and backward (see ``delta_rule``).

Used on CUDA tensors; on CPU tensors they run under ``TRITON_INTERPRET=1`` (how the tests check
them against the torch chunked form). Triton is imported lazily, on first use.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

__all__ = ["resolve_backend", "triton_available", "triton_chunk_delta_rule"]


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (it ships with Linux torch wheels)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    """``auto`` → Triton on CUDA when importable, torch elsewhere; explicit names are checked."""
    from .delta_rule import DELTA_RULE_BACKENDS

    if backend not in DELTA_RULE_BACKENDS:
        raise ValueError(
            f"linear-attention backend must be one of {DELTA_RULE_BACKENDS}, got {backend!r}"
        )
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("linear-attention backend 'triton' needs triton, which is missing")
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"linear-attention backend 'triton' needs CUDA tensors (got {device.type}); on "
                "CPU set TRITON_INTERPRET=1 before triton is first imported"
            )
    return backend  # type: ignore[return-value]


def triton_chunk_delta_rule(*args, **kwargs):
    raise NotImplementedError
