"""Skip markers for tests that need CUDA devices."""

from __future__ import annotations

import pytest


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 when torch has no CUDA or no driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int = 1) -> pytest.MarkDecorator:
    """``@requires_gpus(2)``: skip the test with a clear reason unless ``n`` GPUs are visible."""
    have = cuda_device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA device(s), found {have}")
