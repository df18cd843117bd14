"""``SaveHandle``: the pending write of one save on this rank."""

from __future__ import annotations

import threading


class SaveHandle:
    """The pending write of one save on this rank.

    ``wait()`` returns once this rank's files, done-marker (and, on rank 0, the manifest) are
    written, and raises if writing failed. The checkpoint is complete, and listed by
    ``latest_step()``, once every rank's part is.
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._reported = False

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._event.is_set() else "pending"
        return f"SaveHandle(step={self.step}, path={self.path!r}, {state})"

    def done(self) -> bool:
        """Whether this rank's write has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this rank's write has finished; raise its error if it failed."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still writing after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()
