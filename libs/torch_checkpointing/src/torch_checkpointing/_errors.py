"""Exceptions raised by torch_checkpointing (importable without torch)."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "StateMismatchError",
]


class CheckpointError(RuntimeError):
    """Base class of every error this library raises about checkpoints."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint exists for the requested step (or at all)."""


class CheckpointWriteError(CheckpointError):
    """A save failed while writing; the checkpoint it was writing is not complete and earlier
    checkpoints are untouched."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated, or fails its checksum; the message names it."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class StateMismatchError(CheckpointError, ValueError):
    """The state given to ``load`` does not match the checkpoint.

    ``missing``: entries of the target absent from the checkpoint; ``unexpected``: checkpoint
    entries absent from the target; ``mismatched``: entries present in both whose kind, shape
    or dtype differ, as ``(name, what the target has, what the checkpoint has)``.
    """

    def __init__(
        self,
        message: str,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, str, str]],
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
