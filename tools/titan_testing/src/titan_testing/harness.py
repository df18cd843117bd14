"""Run one function on N processes that form a real ``torch.distributed`` process group.

Design:

* The parent hosts the rendezvous ``TCPStore`` on an OS-chosen port (port 0), so there is
  no "find a free port, hope nobody takes it" race.
* Each rank is a fresh ``python -m titan_testing._worker`` subprocess started in its own
  session (process group), so killing it also kills anything it started.
* The function travels by reference (file + qualified name), its arguments by pickle; the
  worker writes its pickled result or its formatted traceback to a file and exits.
* The parent polls all ranks: the first failure gives the other ranks a short grace period
  and then kills them; a deadline kills every rank still running, after asking each one for
  its Python stacks (``faulthandler`` on ``SIGUSR1``), which go into the error message.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "run_distributed",
]

_BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
_POLL_S = 0.02


class DistributedTestError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank to that rank's traceback text."""

    def __init__(self, message: str, failures: dict[int, str], pids: list[int]) -> None:
        super().__init__(message)
        self.failures = failures
        self.pids = pids


class DistributedTimeoutError(DistributedTestError):
    """Some ranks did not finish before the deadline; they were killed."""


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: subprocess.Popen
    result_path: Path
    error_path: Path
    stacks_path: Path
    done: bool = False
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _function_reference(fn: Callable[..., Any]) -> tuple[str, str, str]:
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if qualname is None or module is None or not inspect.isfunction(fn):
        raise TypeError(
            f"run_distributed: fn must be a plain module-level function, got {fn!r}; "
            "define it at the top level of the test module"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"run_distributed: fn {qualname!r} is a lambda or a local function and cannot be "
            "sent to child processes; define it at the top level of the test module"
        )
    try:
        file = inspect.getfile(fn)
    except TypeError as e:
        raise TypeError(f"run_distributed: cannot locate the source file of {qualname!r}") from e
    return module, str(Path(file).resolve()), qualname


def _pickle_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    for i, a in enumerate(args):
        try:
            pickle.dumps(a)
        except Exception as e:
            raise TypeError(
                f"run_distributed: positional argument {i} ({a!r:.80}) is not picklable: {e}"
            ) from e
    for k, v in kwargs.items():
        try:
            pickle.dumps(v)
        except Exception as e:
            raise TypeError(f"run_distributed: keyword argument {k!r} is not picklable: {e}") from e
    return pickle.dumps((tuple(args), kwargs))


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    num_threads: int | None = None,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    grace: float = 3.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results by rank.

    Each rank runs in its own process with ``torch.distributed`` initialised (``backend``),
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, and ``torch.set_num_threads(num_threads)``
    (default: the CPU count divided by the world size, at least 1). ``fn`` must be a
    module-level function and its arguments and return value picklable.

    Raises ``DistributedTestError`` (with every failing rank's traceback) when a rank raises
    or dies, and ``DistributedTimeoutError`` when ranks are still running after ``timeout``
    seconds; in both cases every rank and everything it started has been killed.
    With ``init_process_group=False`` no group is formed, and ``MASTER_ADDR``/``MASTER_PORT``
    point to a free port for code that initialises its own.
    """
    if (outer := os.environ.get(_RANK_ENV)) is not None:
        raise RuntimeError(
            f"run_distributed called inside rank {outer} of another run_distributed: the module "
            "that defines the function calls the harness when it is imported (each rank imports "
            "it again, and would spawn ranks of its own); put the call under "
            '`if __name__ == "__main__":` or in a test function'
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"run_distributed: backend must be one of {_BACKENDS}, got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"run_distributed: timeout must be > 0 seconds, got {timeout!r}")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"run_distributed: num_threads must be >= 1, got {num_threads!r}")
    module, file, qualname = _function_reference(fn)
    payload_args = _pickle_arguments(args, kwargs)

    import torch.distributed as dist  # deferred: keeps `import titan_testing` cheap

    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    if init_process_group:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        port = store.port
    else:
        store = None
        port = _free_port()

    with tempfile.TemporaryDirectory(prefix="titan_dist_") as tmp:
        tmpdir = Path(tmp)
        payload = {
            "module": module,
            "file": file,
            "qualname": qualname,
            "args": payload_args,
            "backend": backend,
            "world_size": world_size,
            "port": port,
            "num_threads": num_threads,
            "init_process_group": init_process_group,
            "sys_path": list(sys.path),
        }
        payload_path = tmpdir / "payload.pkl"
        payload_path.write_bytes(pickle.dumps(payload))
        ranks = [
            _start_rank(r, world_size, payload_path, tmpdir, port, env) for r in range(world_size)
        ]
        try:
            _wait(ranks, timeout=timeout, grace=grace)
        finally:
            for r in ranks:
                _kill_group(r.proc)
                r.proc.wait()
            del store
        return [pickle.loads(r.result_path.read_bytes()) for r in ranks]


_RANK_ENV = "TITAN_TESTING_RANK"
"""Set in every rank's environment: a rank that calls ``run_distributed`` again is refused."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_rank(
    rank: int,
    world_size: int,
    payload_path: Path,
    tmpdir: Path,
    port: int,
    env: dict[str, str] | None,
) -> _Rank:
    child_env = dict(os.environ)
    child_env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    child_env[_RANK_ENV] = str(rank)
    if env:
        child_env.update(env)
    result_path = tmpdir / f"result_{rank}.pkl"
    error_path = tmpdir / f"error_{rank}.txt"
    stacks_path = tmpdir / f"stacks_{rank}.txt"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "titan_testing._worker",
            str(payload_path),
            str(rank),
            str(result_path),
            str(error_path),
            str(stacks_path),
        ],
        env=child_env,
        start_new_session=True,
    )
    return _Rank(rank, proc, result_path, error_path, stacks_path)


def _wait(ranks: list[_Rank], *, timeout: float, grace: float) -> None:
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while True:
        for r in ranks:
            if r.done:
                continue
            code = r.proc.poll()
            if code is None:
                continue
            r.done = True
            if code != 0 or not r.result_path.exists():
                r.error = (
                    r.error_path.read_text()
                    if r.error_path.exists()
                    else f"rank {r.rank} exited with code {code} and left no result "
                    f"(killed by signal {-code})"
                    if code < 0
                    else f"rank {r.rank} exited with code {code} and left no result"
                )
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
        running = [r for r in ranks if not r.done]
        failed = {r.rank: r.error for r in ranks if r.error is not None}
        now = time.monotonic()
        if not running:
            break
        if first_failure_at is not None and now - first_failure_at > grace:
            break
        if now > deadline:
            _raise_timeout(ranks, running, failed, timeout)
        time.sleep(_POLL_S)
    failed = {r.rank: r.error for r in ranks if r.error is not None}
    if failed:
        pids = [r.proc.pid for r in ranks]
        stuck = [r.rank for r in ranks if not r.done]
        lines = [f"{len(failed)} of {len(ranks)} ranks failed: {sorted(failed)}"]
        if stuck:
            lines.append(f"ranks {stuck} were still running and were killed")
        for rank, text in sorted(failed.items()):
            lines.append(f"--- rank {rank} ---\n{text.rstrip()}")
        raise DistributedTestError("\n".join(lines), failed, pids)


def _raise_timeout(
    ranks: list[_Rank], running: list[_Rank], failed: dict[int, str], timeout: float
) -> None:
    for r in running:
        _kill_group_leader(r.proc, signal.SIGUSR1)
    time.sleep(0.5)
    lines = [
        f"ranks {[r.rank for r in running]} of {len(ranks)} still running after "
        f"{timeout:.1f} s; killed"
    ]
    for rank, text in sorted(failed.items()):
        lines.append(f"--- rank {rank} failed ---\n{text.rstrip()}")
    for r in running:
        stacks = r.stacks_path.read_text() if r.stacks_path.exists() else ""
        lines.append(f"--- rank {r.rank} stacks at timeout ---\n{stacks.rstrip() or '(none)'}")
    for r in ranks:
        _kill_group(r.proc)
    raise DistributedTimeoutError("\n".join(lines), dict(failed), [r.proc.pid for r in ranks])


def _kill_group_leader(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
