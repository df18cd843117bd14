"""Where a step's time and memory go: per-phase step times, torch.profiler traces and memory
snapshots (``--profiling.*``).

``StepPhases`` times the phases of every step — ``data``, ``forward``, ``backward``
(``forward_backward`` under pipelining), ``optimizer`` (clipping and the update),
``collectives`` (the step's own all-reduces: the token count and the loss; flexshard's
overlapped gathers and reductions run inside forward / backward), ``validation`` and
``checkpoint`` (the blocking part of a save) — without a host synchronisation: on an
accelerator each boundary records an event and the elapsed times are read at the log step,
after the one host read the trainer makes there anyway; on the CPU, where ops run
synchronously, a clock is read. ``metrics.jsonl`` gets ``<phase>_s``, the mean seconds per
step since the previous log line (validation and checkpoint run after a step's line: they
count in the next one). Each phase is also a ``torch.profiler.record_function`` range,
so a trace shows it by name.

``Tracer`` runs ``torch.profiler`` over steps ``a`` to ``b`` (``--profiling.trace-steps a:b``)
and writes ``<run>/profiling/trace_rank<r>.json`` (Chrome / Perfetto JSON). With
``--profiling.memory-snapshot``, on CUDA the allocator's history is recorded and dumped to
``<run>/profiling/memory_snapshot_rank<r>.pickle`` (open it in pytorch.org/memory_viz); on the
CPU the bytes each module saves for backward in the first step are counted
(``activation_memory_rank<r>.txt`` / ``.json``: storages counted once, in the module that
saved them first).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ActivationMemory", "StepPhases", "Tracer", "parse_steps"]


def parse_steps(text: str) -> tuple[int, int] | None:
    """``"a:b"`` -> (a, b) with 1 <= a <= b; ``""`` -> None; ``ValueError`` naming the field."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise ValueError(
            f"profiling.trace_steps={text!r} must read 'a:b' with 1 <= a <= b (steps, 1-based)"
        )
    return a, b


class StepPhases:
    """Seconds per phase, summed over the steps since the last ``read`` (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type not in ("cpu", "meta")
        self._device = device
        self._open: list[tuple[str, Any]] = []  # (phase, start) not yet read
        self._done: list[tuple[str, Any, Any]] = []
        self.steps = 0

    def _now(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = torch.Event(device=self._device, enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed work as ``name`` (and name it in a profiler trace)."""
        start = self._now()
        with torch.profiler.record_function(name):
            yield
        self._done.append((name, start, self._now()))

    def read(self) -> dict[str, float]:
        """``<phase>_s``: mean seconds per step since the last read (synchronises the events
        recorded so far: call it where the host waits for the device anyway)."""
        totals: dict[str, float] = {}
        for name, start, end in self._done:
            if self.events:
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000.0
            else:
                seconds = end - start
            totals[name] = totals.get(name, 0.0) + seconds
        steps = max(1, self.steps)
        self._done, self.steps = [], 0
        return {f"{k}_s": v / steps for k, v in totals.items()}


class Tracer:
    """torch.profiler over steps ``a``..``b`` (1-based, inclusive) of this rank."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int) -> None:
        self.steps, self.out_dir, self.rank = steps, out_dir, rank
        self._profiler: Any = None
        self.path: Path | None = None

    def before_step(self, step: int) -> None:
        """Call with the step about to run (1-based)."""
        if self.steps is None or step != self.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def after_step(self, step: int) -> None:
        """Call with the step that just ran; the trace is written after step ``b``."""
        if self._profiler is None or step != self.steps[1]:  # type: ignore[index]
            return
        self.close()

    def close(self) -> None:
        """Stop and write the trace (a run that ends inside the range writes what it has)."""
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"trace_rank{self.rank}.json"
        self._profiler.export_chrome_trace(str(self.path))
        self._profiler = None


class ActivationMemory:
    """Bytes saved for backward per module over one forward (CPU form of the memory
    snapshot): storages counted once, in the innermost module running when first saved."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.bytes: dict[str, int] = {}
        self._stack: list[str] = []
        self._seen: set[int] = set()
        self._handles: list[Any] = []

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Count what the enclosed forward saves (run the backward after leaving it)."""
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave))

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen and storage.nbytes():
                self._seen.add(storage.data_ptr())
                where = self._stack[-1] if self._stack else "(outside modules)"
                self.bytes[where] = self.bytes.get(where, 0) + storage.nbytes()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name or "(model)")

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def write(self, out_dir: Path, rank: int) -> Path:
        """``activation_memory_rank<r>.json`` and ``.txt`` (largest first); the text's path."""
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = sorted(self.bytes.items(), key=lambda kv: -kv[1])
        total = sum(self.bytes.values())
        (out_dir / f"activation_memory_rank{rank}.json").write_text(
            json.dumps({"total_bytes": total, "modules": dict(rows)}, indent=2) + "\n"
        )
        lines = [f"{'module':<48} {'MiB':>10} {'share':>7}"]
        lines += [f"{n:<48} {b / 2**20:>10.3f} {b / max(1, total):>7.1%}" for n, b in rows]
        lines.append(f"{'total':<48} {total / 2**20:>10.3f}")
        path = out_dir / f"activation_memory_rank{rank}.txt"
        path.write_text("\n".join(lines) + "\n")
        return path


@contextlib.contextmanager
def cuda_memory_history(enabled: bool, out_dir: Path, rank: int) -> Iterator[None]:
    """Record the CUDA allocator's history while the block runs and dump it at the end."""
    if not (enabled and torch.cuda.is_available()):
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(out_dir / f"memory_snapshot_rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
