"""What a run tells its user on the console: a header before the first step (run folder,
model size, layout, steps, resume or archive), a closing line (where the results are, the
final losses), and Ctrl-C as one line with the step to resume from.

Ctrl-C (SIGINT) does not raise in the middle of a step: ``StopRequest`` turns it into a flag
the loop reads between steps, so the weights, the optimizer and the step counter always agree
when the run stops. A second Ctrl-C raises ``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from titan_train.config import JobConfig

EXIT_INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (128 + SIGINT, the shell's convention)."""


class Interrupted(Exception):
    """The run stopped on Ctrl-C at ``step``; ``resume_step`` is the checkpoint a rerun of the
    same command resumes from (None: there is none, a rerun starts over)."""

    def __init__(self, step: int, resume_step: int | None, checkpoints: bool) -> None:
        self.step, self.resume_step = step, resume_step
        if resume_step is not None:
            then = f"rerun the same command to resume from step {resume_step}"
        elif checkpoints:
            then = "no checkpoint was complete yet: a rerun starts over"
        else:
            then = "checkpoints are off (checkpoint.interval=0): a rerun starts over"
        super().__init__(f"interrupted at step {step}; {then}")


class StopRequest:
    """While entered: the first SIGINT sets ``requested`` (read between steps); a second
    raises ``KeyboardInterrupt``. Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def header(
    cfg: JobConfig,
    *,
    run_dir: Path,
    num_params: int,
    layout: dict[str, int],
    device: str,
    resume_step: int | None,
    archived: Path | None,
) -> str:
    """The lines printed before the first step."""
    t = cfg.training
    shown = " ".join(f"{k}={v}" for k, v in layout.items() if v != 1 or k == "dp_shard")
    world = layout_world(layout)
    if resume_step is not None:
        start = f"resuming from the step-{resume_step} checkpoint"
    else:
        start = "a fresh start"
        if archived is not None:
            start += f"; the previous run's outputs were moved to {archived}"
    ckpt = cfg.checkpoint
    saves = (
        f"checkpoints every {ckpt.interval} steps and at the end (keep {ckpt.keep_last})"
        if ckpt.interval
        else "checkpoints off"
    )
    return "\n".join(
        [
            f"titan-train: {cfg.name}: {cfg.model.family} {cfg.model.flavor}, "
            f"{num_params / 1e6:,.1f} M parameters, {world} process{'es' * (world > 1)} "
            f"({shown}) on {device}",
            f"  {t.steps} steps of {t.batch_size} x {t.seq_len} tokens per data-parallel rank; "
            f"{saves}",
            f"  run folder {run_dir}: {start}",
        ]
    )


def layout_world(layout: dict[str, int]) -> int:
    """Processes of a layout (``ep`` is carved out of the others)."""
    n = 1
    for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        n *= layout.get(k, 1)
    return n


def closing(summary: dict[str, Any], *, run_dir: Path, validation: float | None) -> str:
    """The last line of a completed run: final losses and where the results are."""
    losses = summary["losses"]
    shown = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step logged"
    if validation is not None:
        shown += f", validation {validation:.4f}"
    outputs = [
        n for n in ("metrics.jsonl", "loss.png", "checkpoints", "hf") if (run_dir / n).exists()
    ]
    return f"titan-train: done at step {summary['step']} ({shown}); results in {run_dir}/ ({', '.join(outputs)})"


def finished(run_dir: Path, step: int) -> str:
    """The line of a rerun whose run is already complete (nothing is done or written)."""
    return (
        f"titan-train: {run_dir} already finished (checkpoint at step {step} of {step}); "
        "nothing to do. Train further with --training.steps N --allow-config-change, or start "
        "another run with --name"
    )
