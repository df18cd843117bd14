"""Dev-only test support for Titan: run a function on N ranks of a real process group."""

from titan_testing.gpu import cuda_device_count, requires_gpus
from titan_testing.harness import DistributedTestError, DistributedTimeoutError, run_distributed

__version__ = "0.1.0"

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "__version__",
    "cuda_device_count",
    "requires_gpus",
    "run_distributed",
]
