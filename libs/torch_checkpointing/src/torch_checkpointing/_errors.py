"""Exceptions raised by torch_checkpointing (importable without torch)."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointWarning",
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


class CheckpointLockedError(CheckpointError):
    """Another live manager (``holder``: its pid, host, start time, rank) uses the same root."""

    def __init__(self, message: str, holder: dict | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class CheckpointWarning(UserWarning):
    """Something about a checkpoint the caller should know but that stops nothing: a damaged
    checkpoint left in place, a fallback load, a stale lock taken over, a failed retention."""


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

    @classmethod
    def listing(
        cls,
        where: str,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, str, str]],
    ) -> StateMismatchError:
        """The error for ``where``, its message listing every difference (20 of each kind)."""
        lines = [f"load: the state does not match {where}; nothing was loaded"]
        if missing:
            lines.append(f"  missing from the checkpoint ({len(missing)}): {missing[:20]}")
        if unexpected:
            lines.append(
                f"  in the checkpoint but not in the state ({len(unexpected)}): {unexpected[:20]}"
            )
        for name, have, ckpt in mismatched[:20]:
            lines.append(f"  mismatched {name}: state has {have}, checkpoint has {ckpt}")
        if len(mismatched) > 20:
            lines.append(f"  ... and {len(mismatched) - 20} more mismatched")
        return cls("\n".join(lines), missing, unexpected, mismatched)
