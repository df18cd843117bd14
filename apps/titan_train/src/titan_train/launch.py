"""``--nproc N``: the ranks run through torchrun's elastic agent, with two changes to how a
job ends.

- After a failure, the other ranks get ``FAILED_GRACE_S`` to exit on SIGTERM before SIGKILL
  (torchrun waits 30 s). A rank that is stopped or stuck ignores SIGTERM: the 30 s only
  delayed the end of a job whose peers had already timed out on it (``comm.timeout_s``).
  A rank that exits as interrupted (Ctrl-C) leaves torchrun's own handling in place.
- The ranks that had to be killed are named in the job's last line: they stopped
  responding. A rank's traceback goes to its log in the run folder
  (``logs/rank-<r>.log``), and the console gets one line per failed rank.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

from titan_train.config import JobConfig
from titan_train.run_report import EXIT_INTERRUPTED

MONITOR_S = 0.5
"""How often torchrun checks its ranks (seconds)."""

FAILED_GRACE_S = 2
"""Seconds the other ranks get to exit on SIGTERM once one has failed."""


def relaunch(cfg: JobConfig, nproc: int, args: list[str]) -> int:
    """Run ``titan-train args`` (without ``--nproc``) on ``nproc`` processes; the exit
    status, after one line naming what failed."""
    launch = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--monitor-interval={MONITOR_S}",
    ]
    with _agent() as agent:
        try:
            torchrun([*launch, "-m", "titan_train", *args])
        except SignalException:  # Ctrl-C: torchrun passed it to the ranks; rank 0 said where
            return EXIT_INTERRUPTED
        except ChildFailedError as e:
            codes = {rank: f.exitcode for rank, f in e.failures.items()}
            if all(c == EXIT_INTERRUPTED for c in codes.values()):
                return EXIT_INTERRUPTED  # the ranks were interrupted: rank 0 printed the line
            print(f"titan-train: error: {_failure(cfg, codes, agent.killed)}", file=sys.stderr)
            return 2 if all(c == 2 for c in codes.values()) else 1
    return 0


def _failure(cfg: JobConfig, codes: dict[int, int], killed: list[int]) -> str:
    logs = Path(cfg.output_dir) / cfg.name / "logs"
    if killed:
        ranks = ", ".join(f"rank {r}" for r in killed)
        failed = ", ".join(
            f"rank {r} (exit code {c})" for r, c in sorted(codes.items()) if r not in killed
        )
        return (
            f"{ranks} stopped responding: {'it' if len(killed) == 1 else 'they'} ignored "
            f"SIGTERM once {failed or 'a peer'} had failed (a rank that waits on a stopped peer "
            f"fails after --comm.timeout-s {cfg.comm.timeout_s:g}) and "
            f"{'was' if len(killed) == 1 else 'were'} killed; rank logs: {logs}"
        )
    shown = ", ".join(f"rank {rank} exit code {c}" for rank, c in sorted(codes.items()))
    return f"the job failed ({shown}); see above and the rank logs in {logs}"


class _Agent(LocalElasticAgent):
    """torchrun's agent; once a rank has failed, it ends the others itself, after
    ``FAILED_GRACE_S`` (torchrun's process context waits 30 s, a default nothing sets)."""

    killed: ClassVar[list[int]] = []
    """Ranks that ignored SIGTERM after a failure and were killed (global ranks)."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._end_peers_of_a_failed_rank(worker_group)
        return super()._monitor_workers(worker_group)

    def _end_peers_of_a_failed_rank(self, worker_group: WorkerGroup) -> None:
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        codes = {r: h.proc.poll() for r, h in handlers.items()}
        failed = [c for c in codes.values() if c not in (None, 0)]
        alive = [r for r, c in codes.items() if c is None]
        if not failed or not alive or EXIT_INTERRUPTED in failed:  # Ctrl-C: ranks may save
            return
        for r in alive:
            handlers[r].close(death_sig=signal.SIGTERM)
        end = time.monotonic() + FAILED_GRACE_S
        for r in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                handlers[r].proc.wait(max(0.0, end - time.monotonic()))
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        for r in alive:
            if handlers[r].proc.poll() is None:
                handlers[r].close(death_sig=signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    handlers[r].proc.wait(FAILED_GRACE_S)  # unkillable (D state): torchrun's
                _Agent.killed.append(ranks.get(r, r))


@contextlib.contextmanager
def _agent() -> Iterator[type[_Agent]]:
    """torchrun (``launcher_api.launch_agent``) builds its agent from that module's name."""
    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _Agent
    _Agent.killed = []
    try:
        yield _Agent
    finally:
        launcher_api.LocalElasticAgent = saved


def report_rank_failure(cfg: JobConfig, rank: int, error: BaseException) -> None:
    """A rank's unexpected error: the traceback to ``logs/rank-<rank>.log`` in the run folder
    (when the run folder exists: a rank never creates it), one line to the console."""
    run_dir = Path(cfg.output_dir) / cfg.name
    text = "".join(traceback.format_exception(error))
    first = (str(error).strip().splitlines() or [""])[0][:300]
    if not run_dir.is_dir():
        print(text, file=sys.stderr, end="", flush=True)
        return
    log = run_dir / "logs" / f"rank-{rank}.log"
    try:
        log.parent.mkdir(exist_ok=True)
        with log.open("a") as f:
            f.write(text)
    except OSError:
        print(text, file=sys.stderr, end="", flush=True)
        return
    print(
        f"titan-train: rank {rank}: {type(error).__name__}: {first} (traceback: {log})",
        file=sys.stderr,
        flush=True,
    )
