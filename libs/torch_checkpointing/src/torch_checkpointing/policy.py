"""``CheckpointPolicy``: how a ``CheckpointManager`` writes, keeps and reads checkpoints.

Imports no torch (the writer process never needs it, but the manager validates it first).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._format import DEFAULT_BLOCK_SIZE

__all__ = ["ASYNC_MODES", "CheckpointPolicy"]

ASYNC_MODES = ("process", "thread", "off")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointPolicy:
    """The options of a ``CheckpointManager``, checked when built."""

    async_mode: str = "process"
    """``"process"`` (a torch-free writer process per rank does the I/O), ``"thread"`` (a
    writer thread), or ``"off"`` (``save`` writes before returning)."""
    keep_last: int | None = None
    """Keep the newest N complete checkpoints of this run's lineage (older ones of it are
    deleted by rank 0 once a newer one is complete); ``None`` keeps all."""
    staging_slots: int = 1
    """Staging buffers per layout, 1..8: with 1 a save waits for the previous write before
    staging; with 2 one save can be staged while the previous one is being written."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Bytes per checksum block, a power of two >= 4096; loads read whole blocks."""
    io_threads: int = 8
    """Parallel reads during ``load``."""
    read_only: bool = False
    """Only list and load: no lock on the root, ``save`` raises. For evaluation jobs that read
    the checkpoints another job writes, and for read-only folders."""

    def __post_init__(self) -> None:
        if self.async_mode not in ASYNC_MODES:
            raise ValueError(
                f"CheckpointPolicy: async_mode must be one of {ASYNC_MODES}, got "
                f"{self.async_mode!r}"
            )
        if self.keep_last is not None and (not _is_int(self.keep_last) or self.keep_last < 1):
            raise ValueError(
                f"CheckpointPolicy: keep_last must be None or an int >= 1, got {self.keep_last!r}"
            )
        if not _is_int(self.staging_slots) or not 1 <= self.staging_slots <= 8:
            raise ValueError(
                f"CheckpointPolicy: staging_slots must be an int in [1, 8], got "
                f"{self.staging_slots!r}"
            )
        b = self.block_size
        if not _is_int(b) or b < 4096 or b & (b - 1):
            raise ValueError(
                f"CheckpointPolicy: block_size must be a power of two >= 4096, got {b!r}"
            )
        if not _is_int(self.io_threads) or self.io_threads < 1:
            raise ValueError(
                f"CheckpointPolicy: io_threads must be an int >= 1, got {self.io_threads!r}"
            )
        if not isinstance(self.read_only, bool):
            raise TypeError(f"CheckpointPolicy: read_only must be a bool, got {self.read_only!r}")
