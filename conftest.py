"""Test isolation for the whole repository: each test starts from torch's process defaults.

pytest-xdist runs many test files in one worker process, in an order that changes between
runs. A test or a module fixture that sets the intra-op thread count (or the default dtype,
grad mode, deterministic algorithms) and does not put it back changes how BLAS blocks the
next test's sums, so a tolerance could hold or fail depending on which file ran before.
Whatever a test changes of these is restored when it ends, and whatever a module's fixtures
change, when the module ends. Each test also starts from torch's and Python's random
generators seeded with 0, so its random inputs are the same in every run and order: a failure
in CI reproduces with the same test run alone.

Under pytest-xdist each worker starts with its share of the machine's cores as its intra-op
threads (2 workers on 2 cores: 1 thread each), not torch's default of every core per worker:
oversubscribed OpenMP regions wait at their barriers for threads the OS has descheduled.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in xdist workers
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def _settings() -> tuple[int, torch.dtype, bool, bool, bool]:
    return (
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _restore(settings: tuple[int, torch.dtype, bool, bool, bool]) -> None:
    if _settings() == settings:
        return
    threads, dtype, grad, deterministic, warn_only = settings
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_torch_settings() -> Iterator[None]:
    settings = _settings()
    yield
    _restore(settings)


@pytest.fixture(autouse=True)
def _test_leaves_torch_settings() -> Iterator[None]:
    settings = _settings()
    torch.manual_seed(0)
    random.seed(0)
    yield
    _restore(settings)
