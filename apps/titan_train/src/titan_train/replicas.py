"""``titan-train lighthouse`` and ``--fault-tolerance.local-replicas N``: the torchft
lighthouse, and N fault-tolerant replica groups on this host for tests and demos.

The local launcher starts a lighthouse in this process, then N replica groups, each this
same command with ``--fault-tolerance.enable --fault-tolerance.replica-id i`` (and its own
``--nproc`` ranks); their output comes back prefixed ``[replica i]``. A group that dies is
started again (up to ``--fault-tolerance.max-restarts``): it joins the next quorum and heals
from a live peer. The job exits 0 once the surviving groups finish.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from titan_train.config import JobConfig

EXIT_NO_PEER = 75
"""Exit status of a restarted replica group that found no live peer to heal from."""

JOIN_TIMEOUT_MS = 5000
"""Local lighthouse: how long a quorum waits for heartbeating groups that have not asked."""

HEARTBEAT_TIMEOUT_MS = 5000
"""Local lighthouse: silence after which a group counts as dead (torchft's default)."""

_OWN_FLAGS = ("--fault-tolerance.local-replicas", "--fault_tolerance.local_replicas")


def lighthouse_main(argv: list[str]) -> int:
    """``titan-train lighthouse``: run torchft's lighthouse until Ctrl-C."""
    p = argparse.ArgumentParser(
        prog="titan-train lighthouse",
        description="Run the torchft lighthouse that the replica groups of a fault-tolerant "
        "job (--fault-tolerance.enable) form their quorums with.",
    )
    p.add_argument("--bind", default="[::]:29510", help="address to listen on")
    p.add_argument("--min-replicas", type=int, default=1, help="replica groups a quorum needs")
    p.add_argument("--join-timeout-ms", type=int, default=60000, help="wait for stragglers")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    args = p.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(
        f"titan-train: torchft lighthouse at {server.address()} (min replicas "
        f"{args.min_replicas}): start each replica group with --fault-tolerance.enable "
        f"--fault-tolerance.lighthouse {server.address()}; Ctrl-C stops it",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()


def run_local_replicas(cfg: JobConfig, argv: list[str]) -> int:
    """Launch ``cfg.fault_tolerance.local_replicas`` replica groups of ``titan-train argv``
    with a lighthouse of their own; restart a group that dies. The exit status: 0 once the
    surviving groups finish, 130 on Ctrl-C, else that of the failed groups."""
    from titan_train.run_report import EXIT_INTERRUPTED

    ft = cfg.fault_tolerance
    n = ft.local_replicas
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=ft.min_replicas,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    addr = lighthouse.address()
    run_dir = Path(cfg.output_dir) / cfg.name
    print(
        f"titan-train: {n} replica groups with a torchft lighthouse at {addr}; their run "
        f"folders: {run_dir}/replica-<i>",
        flush=True,
    )
    args = _without_own_flags(argv)
    base = [sys.executable, "-m", "titan_train", *args, "--fault-tolerance.enable"]
    base += ["--fault-tolerance.group-size", str(n), "--fault-tolerance.lighthouse", addr]
    base += ["--fault-tolerance.local-replicas", "0"]

    def start(i: int, restart: int, rejoin: bool) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if restart:
            env |= {"TITAN_FT_RESTART": str(restart), "TITAN_FT_REJOIN": "1" if rejoin else "0"}
        proc = subprocess.Popen(
            [*base, "--fault-tolerance.replica-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher, which passes it on once
        )
        for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            pump = threading.Thread(target=_pump, args=(src, dst, f"[replica {i}] "), daemon=True)
            pump.start()
            pumps.append(pump)
        return proc

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # the replica groups are stopped on the way out

    pumps: list[threading.Thread] = []
    previous = signal.signal(signal.SIGTERM, terminate)

    procs = {i: start(i, 0, False) for i in range(n)}
    restarts = dict.fromkeys(range(n), 0)
    finished: set[int] = set()
    failed: dict[int, int] = {}
    interrupted = False
    try:
        while procs:
            time.sleep(0.2)
            for i, proc in list(procs.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del procs[i]
                if rc == 0 or (rc == EXIT_NO_PEER and finished):
                    finished.add(i)
                elif rc == EXIT_INTERRUPTED or interrupted:
                    interrupted = True
                elif not finished and restarts[i] < ft.max_restarts:
                    restarts[i] += 1
                    print(
                        f"titan-train: replica {i} exited ({_status(rc)}); restart "
                        f"{restarts[i]}/{ft.max_restarts}: it heals from a live peer",
                        flush=True,
                    )
                    procs[i] = start(i, restarts[i], rejoin=bool(procs))
                else:
                    failed[i] = rc
    except KeyboardInterrupt:  # each group stops between steps (and saves, on one process)
        interrupted = True
        for proc in procs.values():
            _signal_group(proc, signal.SIGINT)  # as a terminal's Ctrl-C: torchrun and its ranks
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(600)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs.values():
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        lighthouse.shutdown()
        for pump in pumps:
            pump.join(timeout=5)
    if interrupted and not finished:
        return EXIT_INTERRUPTED
    if finished:
        if failed:
            shown = ", ".join(f"replica {i} ({_status(rc)})" for i, rc in sorted(failed.items()))
            print(f"titan-train: {shown} gave up; the other groups finished", flush=True)
        return 0
    shown = ", ".join(f"replica {i} {_status(rc)}" for i, rc in sorted(failed.items()))
    print(f"titan-train: error: every replica group failed ({shown})", file=sys.stderr)
    return 2 if failed and all(rc == 2 for rc in failed.values()) else 1


def _without_own_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _OWN_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in _OWN_FLAGS)):
            out.append(a)
    return out


def _signal_group(proc: subprocess.Popen[str], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # its own session: its process group is its pid


def _status(rc: int) -> str:
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    return f"exit code {rc}"


def _pump(src: IO[str] | None, dst: IO[str], prefix: str) -> None:
    if src is None:
        return
    for line in src:
        dst.write(prefix + line)
        dst.flush()
