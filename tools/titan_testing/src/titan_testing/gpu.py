"""Skip markers for tests that need CUDA devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 when torch has no CUDA or no driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int = 1) -> Callable[[Any], Any]:
    """``@requires_gpus(2)``: mark the test ``gpu`` (``pytest -m gpu`` selects every GPU check,
    as ``tools/gpu_check.sh`` does) and skip it with a clear reason unless ``n`` GPUs are
    visible."""
    have = cuda_device_count()
    skip = pytest.mark.skipif(have < n, reason=f"needs {n} CUDA device(s), found {have}")

    def mark(test: Any) -> Any:
        return pytest.mark.gpu(skip(test))

    return mark
