"""A step watchdog: a rank whose training step makes no progress for too long ends its job with
a clear error instead of hanging.

The process group's own timeout (``comm.timeout_s``) turns a collective that waits on a dead
or stopped peer into an error on every live rank; the watchdog is the backstop for what no
collective times out (a rank stuck in its own work, a stalled device, a collective library
that ignores its timeout). It never fires before the process-group timeout would have: its
limit is that timeout plus a grace period. When it fires it prints which rank, which step
and how long, dumps every thread's stack, calls ``on_fire`` (the trainer writes the collective
flight recorder there), and exits the process with status 3 (torchrun then ends the other
ranks).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_STALLED = 3
"""Exit status of a rank the watchdog ended."""


class StepWatchdog:
    """Call ``beat(step)`` at least every ``limit_s`` seconds while training; ``pause()``
    around work that may legitimately take longer (a final export), ``close()`` at the end."""

    def __init__(
        self,
        limit_s: float,
        *,
        rank: int = 0,
        poll_s: float | None = None,
        on_fire: Callable[[], object] | None = None,
    ) -> None:
        if not limit_s > 0:
            raise ValueError(f"StepWatchdog: limit_s={limit_s} must be > 0")
        self.limit_s, self.rank, self.on_fire = float(limit_s), rank, on_fire
        self._poll = poll_s if poll_s is not None else min(5.0, self.limit_s / 4)
        self._step = 0
        self._last = time.monotonic()
        self._paused = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="titan-step-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """The job reached ``step``: restart the clock."""
        self._step, self._last, self._paused = step, time.monotonic(), False

    def pause(self) -> None:
        """Stop watching until the next ``beat``."""
        self._paused = True

    def close(self) -> None:
        """Stop the watchdog thread."""
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            idle = time.monotonic() - self._last
            if not self._paused and idle > self.limit_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        print(
            f"titan-train: error: rank {self.rank} made no progress for {idle:.0f} s after "
            f"step {self._step} (limit {self.limit_s:.0f} s: comm.timeout_s plus grace); a "
            "peer rank is stopped or stuck, or this rank is. Stacks of this rank follow; "
            "ending the job.",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        if self.on_fire is not None:
            try:
                self.on_fire()
            except Exception as e:  # the exit below matters more
                print(f"titan-train: watchdog: on_fire failed: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_STALLED)
