"""``LoadStats``: where a load's time went (filled by ``CheckpointManager.load``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["LoadStats", "total_time"]


@dataclass(slots=True)
class LoadStats:
    """Where a load's time went, filled by ``CheckpointManager.load(..., stats=...)``.

    ``total_s`` and ``metadata_s`` / ``deserialize_s`` are wall time of the loading thread;
    ``open_s``, ``read_s``, ``checksum_s``, ``copy_s``, ``wait_s`` are summed over the I/O and
    copy threads (they overlap each other and can add up to more than ``total_s``). Counters
    add up over fallback attempts.
    """

    total_s: float = 0.0
    """Wall time of the whole ``load``."""
    metadata_s: float = 0.0
    """Listing, manifest and done-markers, target checks, read planning."""
    open_s: float = 0.0
    """Opening files and checking their sizes."""
    deserialize_s: float = 0.0
    """Headers (non-tensor state JSON) and applying it (``load_state_dict``, containers)."""
    read_s: float = 0.0
    """Inside ``preadv``: bytes from storage straight into targets or staging."""
    checksum_s: float = 0.0
    """XXH3-64 of every block read."""
    copy_s: float = 0.0
    """Copies from staging into strided / device targets (CUDA: enqueueing them)."""
    wait_s: float = 0.0
    """A reader waiting for its other staging buffer's copies to finish."""
    files: int = 0
    bytes_read: int = 0
    bytes_direct: int = 0
    """Read straight into the targets' memory."""
    bytes_copied: int = 0
    """Copied from staging into targets."""
    staging_peak_bytes: int = 0
    """The loader's own buffers (staging, headers) at their largest, all threads together."""
    attempts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _live: int = field(default=0, repr=False, compare=False)

    def add(self, **amounts: float) -> None:
        """Add to the named fields (thread-safe)."""
        with self._lock:
            for name, v in amounts.items():
                setattr(self, name, getattr(self, name) + v)

    def buffer(self, nbytes: int) -> None:
        """Account ``nbytes`` of loader buffers allocated (negative: freed)."""
        with self._lock:
            self._live += nbytes
            self.staging_peak_bytes = max(self.staging_peak_bytes, self._live)

    def breakdown(self) -> str:
        """One line: each phase's seconds and the bytes moved."""
        return (
            f"total {self.total_s:.3f} s: metadata {self.metadata_s:.3f}, open "
            f"{self.open_s:.3f}, deserialize {self.deserialize_s:.3f}, read {self.read_s:.3f}, "
            f"checksum {self.checksum_s:.3f}, copy {self.copy_s:.3f}, wait {self.wait_s:.3f} s; "
            f"{self.bytes_read / 2**20:.1f} MiB read ({self.bytes_direct / 2**20:.1f} straight "
            f"into targets, {self.bytes_copied / 2**20:.1f} copied), staging peak "
            f"{self.staging_peak_bytes / 2**20:.2f} MiB"
        )


@contextlib.contextmanager
def total_time(stats: LoadStats | None) -> Iterator[None]:
    """Add the wall time of the ``with`` body to ``stats.total_s`` (also when it raises)."""
    if stats is not None and not isinstance(stats, LoadStats):
        raise TypeError(f"load: stats must be a LoadStats or None, got {type(stats).__name__}")
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if stats is not None:
            stats.add(total_s=time.perf_counter() - t0)
