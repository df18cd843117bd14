"""Metrics: a console line, ``metrics.jsonl``, TensorBoard events, optionally Weights & Biases,
and a loss-curve PNG.

The console line is rich (colours, a progress bar) on a terminal and plain text otherwise
(piped to a file or a job log: one unwrapped line per record, no bar characters).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch


def measure_matmul_flops(
    device: torch.device, *, size: int = 1024, dtype: torch.dtype = torch.float32
) -> float:
    """Achieved FLOP/s of a square matmul on ``device``: the "peak" MFU is measured against
    when no ``metrics.peak_flops`` is given (4096² on an accelerator, ``size``² on the CPU)."""
    if device.type != "cpu":
        size = max(size, 4096)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    _synchronize(device)
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < 0.3:
        a @ b
        reps += 1
        _synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class MetricsLogger:
    """Writes each logged step to the console, ``metrics.jsonl``, TensorBoard and W&B (rank 0
    only). A run resumed from ``resumed_step`` drops the records of later steps from
    ``metrics.jsonl`` first (those steps run again and are logged again) and reads the earlier
    ones back, so ``loss.png`` covers the whole run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        tensorboard: bool,
        enabled: bool = True,
        resumed_step: int = 0,
        wandb: dict[str, Any] | None = None,
        echo: bool = True,
    ) -> None:
        """``echo``: print each record's console line (off for a caller that prints its
        own)."""
        self.run_dir, self.total_steps, self.enabled = run_dir, total_steps, enabled
        self.echo = echo
        self._start = time.perf_counter()
        self._start_step = resumed_step
        self._history: dict[str, list[tuple[int, float]]] = {}
        self._tb = self._wandb = None
        if not enabled:
            return
        self._console = None
        if sys.stdout.isatty():
            from rich.console import Console

            self._console = Console(highlight=False)
        if resumed_step:
            _drop_records_after(run_dir / "metrics.jsonl", resumed_step)
            self._history = _read_history(run_dir / "metrics.jsonl")
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if wandb is not None:
            self._wandb = start_wandb(run_dir, **wandb)

    def log(self, step: int, values: dict[str, Any], *, prefix: str = "train") -> None:
        """Record ``values`` for ``step`` (1-based) under ``prefix``: every value goes to
        ``metrics.jsonl``, the numbers also to the history, TensorBoard and W&B."""
        numbers = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for k, v in numbers.items():
            self._history.setdefault(f"{prefix}/{k}", []).append((step, v))
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "split": prefix, **values}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in numbers.items()}, step=step)
        if not self.echo:
            return
        if self._console is not None:
            self._console.print(self._line(step, numbers, prefix, rich=True))
        else:
            print(self._line(step, numbers, prefix, rich=False), flush=True)

    def _line(self, step: int, values: dict[str, float], prefix: str, *, rich: bool) -> str:
        elapsed = time.perf_counter() - self._start
        done = (step - self._start_step) / max(1, self.total_steps - self._start_step)
        eta = elapsed / done * (1 - done) if done > 0 else math.nan
        shown = "  ".join(f"{k} {_fmt(v)}" for k, v in values.items())
        if not rich:
            return f"{prefix:>5} step {step:>5}/{self.total_steps}  {shown}  eta {eta:,.0f}s"
        width = 20
        filled = round(width * step / self.total_steps)
        bar = "█" * filled + "·" * (width - filled)
        colour = "cyan" if prefix == "train" else "magenta"
        return (
            f"[{colour}]{prefix:>5}[/] step {step:>5}/{self.total_steps} {bar} "
            f"{shown}  [dim]eta {eta:,.0f}s[/]"
        )

    def history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs logged so far for ``key`` (e.g. ``"train/loss"``)."""
        return list(self._history.get(key, []))

    def close(self) -> None:
        """Flush files and draw ``loss.png``."""
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._plot_loss()

    def _plot_loss(self) -> None:
        curves = {
            k: self._history[k] for k in ("train/loss", "validation/loss") if self._history.get(k)
        }
        if not curves:  # no step was logged: nothing to draw
            return
        from matplotlib.figure import Figure

        # A Figure of its own, not pyplot: no process-wide backend switch, no figure registry.
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        for key, points in curves.items():
            ax.plot(*zip(*points, strict=True), label=key, marker="." if len(points) < 30 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        accuracy = self._history.get("validation/answer_accuracy")
        if accuracy:  # image-text data: answer accuracy on a second axis
            acc_ax = ax.twinx()
            acc_ax.plot(*zip(*accuracy, strict=True), "g.-", label="validation/answer_accuracy")
            acc_ax.set_ylabel("answer accuracy")
            acc_ax.set_ylim(0, 1)
            acc_ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(self.run_dir / "loss.png", dpi=120)


def _drop_records_after(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (an atomic rewrite; unparsable lines are kept)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] > step:
                continue
        except (ValueError, KeyError, TypeError):
            pass
        kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _read_history(path: Path) -> dict[str, list[tuple[int, float]]]:
    """The numeric records of ``metrics.jsonl`` as ``{"split/key": [(step, value)]}``."""
    history: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
            step, split = int(row.pop("step")), str(row.pop("split"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line cut short by a crash
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                history.setdefault(f"{split}/{k}", []).append((step, float(v)))
    return history


def start_wandb(run_dir: Path, *, project: str, name: str, config: dict[str, Any]) -> Any:
    """A W&B run writing under ``run_dir/wandb`` (``WANDB_MODE=offline``: no account, no
    network). ``ImportError`` naming the package when it is not installed."""
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "metrics.wandb needs the wandb package: pip install wandb (or drop --metrics.wandb)"
        ) from None
    return wandb.init(project=project, name=name, config=config, dir=str(run_dir))


def _fmt(v: float) -> str:
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def memory_bytes(device: torch.device) -> dict[str, Any]:
    """Peak memory allocated on ``device`` (an accelerator) or the process's max RSS (CPU)."""
    if device.type != "cpu":
        return {"mem_gib": torch.accelerator.max_memory_allocated(device) / 2**30}
    import resource

    return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
