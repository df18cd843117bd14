"""The collective flight recorder: the last collectives each rank issued, written to the run
folder when a multi-rank run fails (``--profiling.flight-recorder N``).

torch keeps a ring buffer of the last ``N`` collectives of every process group (NCCL on CUDA,
gloo on the CPU: op, sizes, dtypes, sequence number, state). Its size is read when the first
process group is made, so ``enable`` runs before ``init_process_group`` and sets
``TORCH_FR_BUFFER_SIZE`` for this process only when the user has not set it. When the step
watchdog fires, or an exception leaves a multi-rank training loop, ``dump`` writes

- ``<run>/profiling/flight_recorder_rank<r>.json``: ``reason``, ``rank``, ``backend`` and
  ``trace`` (torch's own JSON: ``entries`` with ``collective_seq_id``, ``profiling_name``,
  ``state``, ``input_sizes``, ...); comparing ranks' last sequence numbers names the rank
  that never joined a collective;
- ``<run>/profiling/stacks_rank<r>.txt``: every thread's Python stack.

Each file is written to a temporary name and renamed, so none is ever half-written.
"""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path

import torch

__all__ = ["ENV", "dump", "enable"]

ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's flight-recorder buffer size (entries per process); 0 or unset: no recording."""


def enable(entries: int) -> None:
    """Record the last ``entries`` collectives (call before the first process group is made);
    an ``ENV`` the user set wins; 0 leaves recording off."""
    if entries > 0 and ENV not in os.environ:
        os.environ[ENV] = str(entries)


def _trace(backend: str) -> dict:
    """torch's flight-recorder JSON for ``backend`` (an ``error`` entry where this torch has
    no recorder to read)."""
    c10d = torch._C._distributed_c10d
    try:
        if backend == "nccl":
            raw = c10d._dump_nccl_trace_json(True, False)  # pyrefly: ignore[missing-attribute]
        else:
            raw = c10d._dump_fr_trace_json(True, False, backend=backend)  # pyrefly: ignore[missing-attribute]
        return json.loads(raw)
    except Exception as e:  # an older torch, a build without the recorder
        return {"error": f"{type(e).__name__}: {e}"}


def _write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dump(out_dir: Path, rank: int, backend: str, reason: str) -> Path | None:
    """Write this rank's flight-recorder trace and stacks into ``out_dir``; returns the trace
    path (None when the recorder is off). Never raises: it runs on the way out of a failure."""
    if int(os.environ.get(ENV, "0") or 0) <= 0:
        return None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {"reason": reason, "rank": rank, "backend": backend, "trace": _trace(backend)}
        path = out_dir / f"flight_recorder_rank{rank}.json"
        _write(path, lambda f: json.dump(record, f))
        _write(
            out_dir / f"stacks_rank{rank}.txt",
            lambda f: faulthandler.dump_traceback(file=f, all_threads=True),
        )
        return path
    except Exception:  # the failure being reported matters more than its flight record
        return None
