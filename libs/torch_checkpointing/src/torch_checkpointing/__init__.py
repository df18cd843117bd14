"""Async distributed checkpoints with one metadata exchange, atomic commits, resharding, HF export.

``import torch_checkpointing`` is cheap: names load on first use, and the background writer
process imports only the torch-free modules (storage, format, retention, writer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointManager": "manager",
    "SaveHandle": "manager",
    "ASYNC_MODES": "policy",
    "CheckpointPolicy": "policy",
    "PerRank": "_tree",
    "Storage": "storage",
    "FileSystemStorage": "storage",
    "FsspecStorage": "storage",
    "save_hf": "hf",
    "load_hf": "hf",
    "parse_size": "hf",
    "CheckpointError": "_errors",
    "CheckpointLockedError": "_errors",
    "CheckpointWarning": "_errors",
    "CheckpointNotFoundError": "_errors",
    "CheckpointWriteError": "_errors",
    "CorruptCheckpointError": "_errors",
    "StateMismatchError": "_errors",
    "LoadStats": "_stats",
}

__all__ = [
    "ASYNC_MODES",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointPolicy",
    "CheckpointWarning",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "FileSystemStorage",
    "FsspecStorage",
    "LoadStats",
    "PerRank",
    "SaveHandle",
    "StateMismatchError",
    "Storage",
    "__version__",
    "load_hf",
    "parse_size",
    "save_hf",
]

if TYPE_CHECKING:  # pragma: no cover
    from ._errors import (
        CheckpointError,
        CheckpointLockedError,
        CheckpointNotFoundError,
        CheckpointWarning,
        CheckpointWriteError,
        CorruptCheckpointError,
        StateMismatchError,
    )
    from ._stats import LoadStats
    from ._tree import PerRank
    from .hf import load_hf, parse_size, save_hf
    from .manager import CheckpointManager, SaveHandle
    from .policy import ASYNC_MODES, CheckpointPolicy
    from .storage import FileSystemStorage, FsspecStorage, Storage


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_checkpointing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
