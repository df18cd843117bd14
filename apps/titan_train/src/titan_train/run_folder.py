"""Run-folder rules: what a job may do with ``<output_dir>/<name>/`` before it writes anything.

- A fresh start (``--checkpoint.no-resume``) in a folder that holds checkpoints is an error,
  unless ``--overwrite`` asks to archive them (moved to ``archive/<time>/``, never deleted).
  Any other fresh start moves a previous run's outputs there too (metrics, config, events).
- Resuming compares the saved ``config.json`` with this job's config. A difference is an
  error that lists it, unless ``--allow-config-change`` is given and every changed field is
  one a resumed run can honour (``RESUMABLE_CHANGES``); the changes are then applied for real
  (learning rate, schedule length) and recorded in ``config.json``'s ``history``.
- Fields that only say how or where the job runs (layout, device, timeouts, the flags
  themselves) may change freely: the checkpoint reshards or refuses with its own error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_train.config import JobConfig
from titan_train.errors import ConfigError

RESUMABLE_CHANGES = (
    "optimizer.lr",
    "optimizer.muon_lr",
    "training.steps",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "checkpoint.async_mode",
    "checkpoint.export_hf",
    "metrics.",
)
"""Fields (or prefixes, ending in ``.``) that ``--allow-config-change`` lets a resume change."""

FREE_FIELDS = (
    "name",
    "output_dir",
    "overwrite",
    "allow_config_change",
    "parallel.",
    "training.device",
    "comm.",
    "checkpoint.resume",
    "checkpoint.init_from_hf",
    "model.attention_backend",
    "compile.",
    "remat.",
    "fault_tolerance.lighthouse",
    "fault_tolerance.local_replicas",
    "fault_tolerance.max_restarts",
    "fault_tolerance.min_replicas",
    "fault_tolerance.process_group",
    "fault_tolerance.timeout_s",
)
"""Fields that say how or where the job runs, not what it trains: never compared."""

ARCHIVED = ("checkpoints", "metrics.jsonl", "config.json", "tensorboard", "loss.png", "hf")
"""What ``--overwrite`` moves into ``archive/<time>/``."""


@dataclass(frozen=True, slots=True)
class RunFolderPlan:
    """What the job will do with its run folder (decided before anything is written)."""

    run_dir: Path
    resume_step: int | None
    """The checkpoint step the job resumes from; None: a fresh start."""
    archive: bool
    """Move the previous run's outputs into ``archive/<time>/`` first (``--overwrite``)."""
    changes: dict[str, tuple[Any, Any]]
    """Fields changed on resume (``--allow-config-change``): name -> (saved, new)."""


def plan_run_folder(cfg: JobConfig, *, check_lock: bool = True) -> RunFolderPlan:
    """Check the run folder against ``cfg`` and say what the job will do; writes nothing.
    Raises ``ConfigError`` naming the folder and the way out. ``check_lock``: fail when
    another job holds the folder (off for the ranks of the job that holds it)."""
    run_dir = Path(cfg.output_dir) / cfg.name
    if check_lock:
        _check_not_in_use(run_dir)
    step, any_checkpoint = _checkpoints(run_dir)
    if any_checkpoint and not cfg.checkpoint.resume:
        if not cfg.overwrite:
            latest = f"latest complete step {step}" if step is not None else "none complete"
            raise ConfigError(
                f"{run_dir} already holds checkpoints ({latest}) and --checkpoint.no-resume "
                "starts a new run: resume it (drop --checkpoint.no-resume), use another "
                "--name, or pass --overwrite to move the old run's outputs to "
                f"{run_dir / 'archive'}/<time>/"
            )
        return RunFolderPlan(run_dir, None, True, {})
    if step is None or cfg.checkpoint.interval == 0:  # a fresh start: old outputs move aside
        return RunFolderPlan(run_dir, None, _has_outputs(run_dir), {})
    saved = _saved_config(run_dir)
    changes = config_changes(saved, dataclasses.asdict(cfg)) if saved is not None else {}
    fixed = {k: v for k, v in changes.items() if not _matches(k, RESUMABLE_CHANGES)}
    if changes and (fixed or not cfg.allow_config_change):
        shown = "; ".join(f"{k}: {a!r} saved, {b!r} now" for k, (a, b) in changes.items())
        if fixed:
            hint = (
                f"{', '.join(fixed)} cannot change within a run: use another --name, or "
                "--checkpoint.no-resume --overwrite to start over"
            )
        else:
            hint = "pass --allow-config-change to apply these changes from the resumed step"
        raise ConfigError(
            f"resuming {run_dir} from step {step} with a different config ({shown}): {hint}"
        )
    return RunFolderPlan(run_dir, step, False, changes)


class RunLock:
    """An exclusive lock on a run folder for the life of a job (rank 0 takes it before it
    reads or moves anything there): a second job on the same folder fails at once."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        """The folders this job created (the run folder first), for ``discard_failed_start``."""
        created = bool(self.created)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None
        """The lock file's descriptor while locked."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if created:  # leave nothing behind
                with contextlib.suppress(OSError):
                    self.path.unlink()
                    run_dir.rmdir()
            raise ConfigError(_in_use(run_dir, holder)) from None
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}".encode(), 0)

    def release(self) -> None:
        """Unlock (the file stays: it is empty of meaning once unlocked)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def discard_failed_start(self) -> None:
        """After a job failed before its first logged step: remove the run folder again if
        this job created it (with the folders above it it created), so that a failed start
        leaves nothing behind. Only this job's own outputs are removed, by name, and only when
        there is no checkpoint, export or logged step; a folder that existed before is never
        touched."""
        run_dir = self.run_dir
        if not self.created or self.created[0] != run_dir:
            return
        metrics = run_dir / "metrics.jsonl"
        if any((run_dir / n).exists() for n in ("checkpoints", "hf", "archive")) or (
            metrics.exists() and metrics.stat().st_size
        ):
            return
        with contextlib.suppress(OSError):
            for name in ("config.json", "metrics.jsonl", "loss.png", LOCK_NAME):
                (run_dir / name).unlink(missing_ok=True)
            if (run_dir / "tensorboard").is_dir():
                for event in (run_dir / "tensorboard").iterdir():
                    if event.name.startswith("events.out.tfevents."):
                        event.unlink()
                (run_dir / "tensorboard").rmdir()
            for folder in self.created:  # each empty by now, or rmdir refuses and we stop
                folder.rmdir()


LOCK_NAME = ".titan-train.lock"


def _check_not_in_use(run_dir: Path) -> None:
    path = run_dir / LOCK_NAME
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(
            _in_use(run_dir, os.pread(fd, 4096, 0).decode(errors="replace"))
        ) from None
    finally:
        os.close(fd)


def _in_use(run_dir: Path, holder: str) -> str:
    return (
        f"{run_dir} is in use by another job ({holder.strip() or 'unknown holder'}); wait for "
        "it to end or use another --name"
    )


def config_changes(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields of two configs (``dataclasses.asdict`` form) that differ, by dotted name,
    leaving out ``FREE_FIELDS`` (with LoRA on, a changed ``checkpoint.init_from_hf`` counts:
    the checkpoints hold the adapters of that base only)."""
    a, b = _flatten(saved), _flatten(new)
    free = FREE_FIELDS
    if b.get("lora.rank"):  # adapter-only checkpoints: the HF base is part of what is trained
        free = tuple(f for f in FREE_FIELDS if f != "checkpoint.init_from_hf")
    out = {}
    for key in sorted(set(a) | set(b)):
        if key != "history" and not _matches(key, free) and a.get(key) != b.get(key):
            out[key] = (a.get(key), b.get(key))
    return out


def archive_outputs(run_dir: Path) -> Path:
    """Move the previous run's outputs into ``run_dir/archive/<time>/`` (rank 0 only)."""
    dest = run_dir / "archive" / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    for name in ARCHIVED:
        if (run_dir / name).exists():
            (run_dir / name).rename(dest / name)
    return dest


def write_config(run_dir: Path, cfg: JobConfig, plan: RunFolderPlan) -> None:
    """``config.json``: this job's config, with the saved history and this resume's changes."""
    saved = _saved_config(run_dir) or {}
    history = list(saved.get("history", []))
    if plan.changes:
        history.append(
            {
                "step": plan.resume_step,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "changes": {k: {"from": a, "to": b} for k, (a, b) in plan.changes.items()},
            }
        )
    record = {**dataclasses.asdict(cfg), "history": history}
    tmp = run_dir / "config.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(run_dir / "config.json")


def apply_resumed_changes(
    plan: RunFolderPlan,
    cfg: JobConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
) -> None:
    """After loading a checkpoint: make an allowed learning-rate change take effect (the
    checkpoint restored the old peak LR into the scheduler and the optimizer). The schedule's
    length follows ``training.steps`` already: the schedule is rebuilt from this config."""
    if not any(k in plan.changes for k in ("optimizer.lr", "optimizer.muon_lr")):
        return
    old = plan.changes.get("optimizer.lr", (cfg.optimizer.lr, cfg.optimizer.lr))[0]
    old_muon = plan.changes.get("optimizer.muon_lr", (cfg.optimizer.muon_lr,) * 2)[0]
    peaks: list[torch.Tensor | float] = []  # LRScheduler.base_lrs's type
    for base in scheduler.base_lrs:  # each group's peak: the AdamW lr or the Muon lr
        is_muon = cfg.optimizer.name == "muon" and base == old_muon and base != old
        peaks.append(cfg.optimizer.muon_lr if is_muon else cfg.optimizer.lr)
    scheduler.base_lrs = peaks
    step = scheduler.last_epoch
    for group, peak, fn in zip(optimizer.param_groups, peaks, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = peak
        group["lr"] = peak * fn(step)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _checkpoints(run_dir: Path) -> tuple[int | None, bool]:
    """The latest complete checkpoint step (None: none) and whether any checkpoint exists,
    complete or not (a damaged one is still a user's data)."""
    root = run_dir / "checkpoints"
    if not root.is_dir() or not any(p.name.startswith("step-") for p in root.iterdir()):
        return None, False
    from torch_checkpointing import CheckpointManager

    with CheckpointManager(root, read_only=True) as ckpt:
        return ckpt.latest_step(), True


def _has_outputs(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ARCHIVED)


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); fix or move it to resume") from None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)
