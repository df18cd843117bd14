"""Run untrusted Python in fresh Linux namespaces with limits on time, memory, processes and disk.

``run_sandboxed`` starts ``_sandbox_supervisor.py`` (a separate ``python -I -S`` process) and
reads its one report from a pipe the program never holds. The run's status comes from that
report (the program's wait status, the timeout) and from the run's cgroup (OOM kills), never
from the program's output. docs/titan_rl_sandbox.md says what is and is not isolated.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import itertools
import marshal
import math
import numbers
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

_LAUNCH = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    "import _sandbox_supervisor; del sys.path[0]; _sandbox_supervisor.main()"
)
_SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
_ISOLATIONS = ("namespaces", "none")
_SUPERVISOR_TASKS = 2  # the supervisor and init share the run's process budget
_BACKSTOP_S = 5.0  # the supervisor enforces the wall limit; this only guards the supervisor
_MAX_WALL_TIME_S = 86_400.0  # one day: beyond it select() and RLIMIT_CPU stop meaning anything
_MAX_BYTES = 1 << 48  # far above any machine, far below the kernel's 64-bit limits
_MAX_PROCESSES = 1 << 22  # the kernel's largest pid_max


class SandboxUnavailableError(RuntimeError):
    """The kernel refused the isolation ``run_sandboxed`` needs; no untrusted code ran."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (the program and every process it starts)."""

    wall_time_s: float = 5.0
    """Wall-clock limit; the whole run (its PID namespace) is killed when it passes."""
    memory_bytes: int = 256 * 2**20
    """Memory of the whole run (cgroup), or of each process (``RLIMIT_AS``) without a cgroup."""
    output_bytes: int = 1 << 20
    """Largest file the run may write, stdout and stderr included (``RLIMIT_FSIZE``)."""
    max_processes: int = 32
    """Processes and threads the program may have at once (cgroup ``pids.max``, ``RLIMIT_NPROC``)."""
    disk_bytes: int = 32 * 2**20
    """Size of the run's only writable folder, ``/tmp`` (a tmpfs; ``/dev/shm`` is the same)."""

    def __post_init__(self) -> None:
        _check_limit("wall_time_s", self.wall_time_s, 0.0, _MAX_WALL_TIME_S, integer=False)
        _check_limit(
            "memory_bytes",
            self.memory_bytes,
            32 * 2**20,
            _MAX_BYTES,
            why=" (the Python interpreter itself needs about 20 MiB)",
        )
        _check_limit("output_bytes", self.output_bytes, 1024, _MAX_BYTES)
        _check_limit("max_processes", self.max_processes, 1, _MAX_PROCESSES)
        _check_limit("disk_bytes", self.disk_bytes, 1 << 20, _MAX_BYTES)


def _check_limit(
    name: str, value: object, low: float, high: float, *, integer: bool = True, why: str = ""
) -> None:
    """One ``ValueError`` naming the field, its value and what is allowed; ``wall_time_s``'s
    lower bound is exclusive (a time of 0 s runs nothing)."""
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok:
        v = cast(float, value)  # an Integral or a Real: what the numbers ABCs do not declare
        ok = math.isfinite(v) and (low <= v if integer else low < v) and v <= high
    if not ok:
        allowed = f"an int in [{low}, {high}]" if integer else f"a finite number in ({low}, {high}]"
        raise ValueError(f"SandboxLimits.{name}={value!r} must be {allowed}{why}")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What a sandboxed run did, as the supervisor and the kernel saw it."""

    status: str
    """``ok`` (exit 0), ``error`` (non-zero exit; or nothing ran: code or stdin not UTF-8
    text, said in ``stderr``), ``timeout`` (wall or CPU limit), ``memory`` (the cgroup's OOM
    killer ended a process of the run, even one that then also ran out of time),
    ``output_limit`` (``RLIMIT_FSIZE``), ``crashed`` (killed by another signal)."""
    returncode: int | None
    """Exit code, ``-signal`` when killed by one, ``None`` on timeout or when nothing ran."""
    stdout: str
    stderr: str
    wall_s: float
    isolation: str
    """``namespaces`` or ``none`` (the caller asked for no isolation)."""
    memory_limit: str
    """How ``memory_bytes`` and ``max_processes`` applied: ``cgroup2`` or ``cgroup1`` (the whole
    run), ``rlimit`` (``RLIMIT_AS`` per process; no cgroup was writable)."""
    peak_memory_bytes: int | None = None
    """Peak memory of the run (cgroup), ``None`` without a cgroup."""


def run_sandboxed(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    isolation: str = "namespaces",
) -> SandboxResult:
    """Run untrusted Python ``code`` isolated and limited; always returns within the limit.

    ``isolation="namespaces"`` (default): fresh user, mount, PID, network, IPC and UTS
    namespaces as an unprivileged uid, a read-only view of the system folders and the
    interpreter, a size-limited ``/tmp``, no host ``/proc``, sockets or processes. Raises
    ``SandboxUnavailableError`` where the kernel refuses that. ``isolation="none"`` runs the
    program as a plain child with the same limits and no isolation at all: only for trusted code.

    Code or stdin that UTF-8 cannot hold (a lone surrogate) is an ``error`` result; nothing
    runs. The run's files on the host (code, stdin, output) are in this process's folder in
    the temp dir and go with the run; those of a caller killed with ``kill -9`` go at the next
    call of any process.
    """
    if isolation not in _ISOLATIONS:
        raise ValueError(f"isolation={isolation!r} must be one of {_ISOLATIONS}")
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("run_sandboxed: code and stdin must be str")
    limits = limits or SandboxLimits()
    encoded = []
    for name, text in (("code", code), ("stdin", stdin)):
        try:
            encoded.append(text.encode())
        except UnicodeEncodeError as e:  # a lone surrogate: no file, no program can hold it
            return _not_run(
                f"run_sandboxed: {name} is not valid UTF-8 text ({e.reason}: "
                f"{text[e.start : e.end]!r} at index {e.start}); nothing ran",
                isolation,
            )
    cgroup = _Cgroup.create(limits)
    try:
        with tempfile.TemporaryDirectory(dir=_process_folder()) as tmp:
            return _run(encoded[0], encoded[1], limits, isolation, cgroup, Path(tmp))
    finally:
        if cgroup is not None:
            cgroup.remove()


def _not_run(message: str, isolation: str) -> SandboxResult:
    """The ``error`` result of a run refused before any process started."""
    parents = _writable_cgroup_parents()
    return SandboxResult(
        status="error",
        returncode=None,
        stdout="",
        stderr=message + "\n",
        wall_s=0.0,
        isolation=isolation,
        memory_limit="rlimit" if parents is None else parents[0],
    )


def _run(
    code: bytes,
    stdin: bytes,
    limits: SandboxLimits,
    isolation: str,
    cgroup: _Cgroup | None,
    folder: Path,
) -> SandboxResult:
    (folder / "main.py").write_bytes(code)
    (folder / "stdin.txt").write_bytes(stdin)
    binds, symlinks = _system_view()
    rlimits = {
        "RLIMIT_CPU": int(limits.wall_time_s) + 1,
        "RLIMIT_FSIZE": limits.output_bytes,
        "RLIMIT_CORE": 0,
    }
    if isolation == "namespaces":  # counted per user namespace: this run's tasks only
        rlimits["RLIMIT_NPROC"] = limits.max_processes + _SUPERVISOR_TASKS
    if cgroup is None:
        rlimits["RLIMIT_AS"] = limits.memory_bytes
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    config = {
        "isolation": isolation,
        "code_path": str(folder / "main.py"),
        "workdir": str(folder),
        "binds": binds,
        "symlinks": symlinks,
        "env": _PROGRAM_ENV,
        "rlimits": rlimits,
        "disk_bytes": limits.disk_bytes,
        "wall_time_s": limits.wall_time_s,
        "report_fd": report_w,
        "go_fd": go_r,
        "parent_pid": os.getpid(),
    }
    # The supervisor's start-up is most of the sandbox's overhead: it is imported (its compiled
    # form is cached, a script's is not) and reads marshal, not json. The interpreter itself,
    # not a venv's link to it: the program's sys.executable must exist in its view.
    python = os.path.realpath(sys.executable)
    args = [python, "-I", "-S", "-c", _LAUNCH, marshal.dumps(config).hex()]
    with (
        open(folder / "stdin.txt", "rb") as fin,
        open(folder / "stdout.txt", "wb") as fout,
        open(folder / "stderr.txt", "wb") as ferr,
        os.fdopen(report_r, "rb") as report_pipe,
        os.fdopen(go_w, "wb", buffering=0) as go,
    ):
        start = time.perf_counter()
        try:
            supervisor = subprocess.Popen(
                args,
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                pass_fds=(report_w, go_r),
                start_new_session=True,
                env={"PATH": _PROGRAM_ENV["PATH"]},
            )
        finally:
            os.close(report_w)
            os.close(go_r)
        try:
            if cgroup is not None:  # while the supervisor's interpreter starts: this can take ms
                cgroup.add(supervisor.pid)
            go.write(b"g")
        except OSError as e:
            supervisor.kill()
            supervisor.wait()
            raise SandboxUnavailableError(f"could not start the sandbox supervisor: {e}") from e
        # Not Popen.wait(timeout): it polls with sleeps of up to 50 ms.
        pidfd = os.pidfd_open(supervisor.pid)
        try:
            if not select.select([pidfd], [], [], limits.wall_time_s + _BACKSTOP_S)[0]:
                supervisor.kill()  # the supervisor hung: its death kills the run
        finally:
            os.close(pidfd)
        supervisor.wait()
        raw = report_pipe.read()
        wall = time.perf_counter() - start
    stdout = _read_capped(folder / "stdout.txt", limits.output_bytes)
    stderr = _read_capped(folder / "stderr.txt", limits.output_bytes)
    try:  # marshal: written by our supervisor only, never by the program
        report = marshal.loads(raw)
    except (EOFError, ValueError, TypeError):
        report = {
            "setup_error": f"the supervisor died without a report (rc {supervisor.returncode})"
        }
    oom_kills = 0 if cgroup is None else cgroup.oom_kills()
    if report.get("setup_error") and not oom_kills:
        raise SandboxUnavailableError(
            f"run_sandboxed(isolation={isolation!r}) could not isolate the program: "
            f"{report['setup_error']}. No untrusted code ran. The kernel must allow user "
            "namespaces (unshare(CLONE_NEWUSER)) and mount_setattr (Linux >= 5.12); pass "
            "isolation='none' only for trusted code."
        )
    status, rc = _status(report, oom_kills)
    return SandboxResult(
        status=status,
        returncode=rc,
        stdout=stdout,
        stderr=stderr,
        wall_s=wall,
        isolation=isolation,
        memory_limit="rlimit" if cgroup is None else cgroup.kind,
        peak_memory_bytes=None if cgroup is None else cgroup.peak_bytes(),
    )


def _status(report: dict, oom_kills: int) -> tuple[str, int | None]:
    """The run's status from the supervisor's report and the cgroup's OOM count only."""
    wait_status = report.get("wait_status")
    rc = None if wait_status is None else os.waitstatus_to_exitcode(wait_status)
    # Before the timeout: under load the OOM kill of a bomb can land just as the wall limit
    # passes, and a run whose child the OOM killer ended can still run into the limit.
    if oom_kills:
        return "memory", rc
    if report.get("timed_out"):
        return "timeout", None
    if rc is None or rc == -signal.SIGXCPU:
        return "timeout", rc
    if rc == -signal.SIGXFSZ:
        return "output_limit", rc
    if rc < 0:
        return "crashed", rc
    return ("ok" if rc == 0 else "error"), rc


def _system_view() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Folders bound read-only into the sandbox (source, destination) and symlinks to copy."""
    binds, symlinks = [], []
    for folder in _SYSTEM_FOLDERS:
        if os.path.islink(folder):
            symlinks.append((folder, os.readlink(folder)))
        elif os.path.isdir(folder):
            binds.append((folder, folder))
    prefix = os.path.realpath(sys.base_prefix)
    python_dir = os.path.dirname(os.path.realpath(sys.executable))
    for extra in (prefix, python_dir):
        covered = [dst for _, dst in binds if extra == dst or extra.startswith(dst + "/")]
        if not covered:
            binds.append((extra, extra))
    return binds, symlinks


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# the runs' files on the host: in a folder of the calling process that outlives it only until
# the next call of any process (a caller killed with kill -9 cannot clean up after itself)

# titan_rl_sandbox_<PID namespace>_<pid>_<start time>_<mkdtemp's 8 characters>
_PROCESS_FOLDER = re.compile(r"titan_rl_sandbox_(\d+)_(\d+)_(\d+)_[a-z0-9_]{8}")
_process_folders: dict[tuple[int, str], Path] = {}  # (pid, temp dir) -> folder
_process_folders_lock = threading.Lock()


def _process_folder() -> Path:
    """This process's folder in the temp dir (made on first use); first removes the folders of
    processes that are gone."""
    temp = tempfile.gettempdir()
    with _process_folders_lock:
        _remove_folders_of_dead_processes(temp)
        pid = os.getpid()
        folder = _process_folders.get((pid, temp))
        if folder is None or not folder.is_dir():
            prefix = f"titan_rl_sandbox_{_pid_namespace()}_{pid}_{_start_time(pid)}_"
            folder = Path(tempfile.mkdtemp(prefix=prefix, dir=temp))  # 0700, never existed
            _process_folders[pid, temp] = folder
            atexit.register(_remove_own_folder, folder, pid)
    return folder


def _remove_own_folder(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child, which inherits the atexit hook
        shutil.rmtree(folder, ignore_errors=True)


def _remove_folders_of_dead_processes(temp: str) -> None:
    """Remove our folders in ``temp`` whose process has exited: exactly our name pattern, our
    PID namespace (other namespaces' pids mean nothing here), owned by us, a real folder (not
    a link), and no live process with that pid and start time (a reused pid is not the owner)."""
    own_namespace = _pid_namespace()
    with os.scandir(temp) as entries:
        for entry in entries:
            match = _PROCESS_FOLDER.fullmatch(entry.name)
            if match is None or int(match[1]) != own_namespace:
                continue
            if _start_time(int(match[2])) == int(match[3]):
                continue  # the owner is alive
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                    shutil.rmtree(entry.path, ignore_errors=True)  # never follows links


def _start_time(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot), ``None`` if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 of proc(5); the name before ")" may hold spaces


@functools.cache
def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


# ---------------------------------------------------------------------------------------------
# cgroups: the only way to bound the memory and process count of a whole run


class _Cgroup:
    """One run's cgroup (v2: one folder; v1: a folder in the memory and in the pids hierarchy).

    Created under this process's own cgroup, so the trainer's limits still apply above it.
    """

    _names = itertools.count()

    def __init__(self, kind: str, folders: list[Path]) -> None:
        self.kind, self.folders = kind, folders

    def add(self, pid: int) -> None:
        """Move process ``pid`` (before it forks) into this cgroup."""
        for folder in self.folders:
            (folder / "cgroup.procs").write_text(str(pid))

    @classmethod
    def create(cls, limits: SandboxLimits) -> _Cgroup | None:
        """A cgroup with the run's limits, or ``None`` where none can be written here."""
        parents = _writable_cgroup_parents()
        if parents is None:
            return None
        kind, parent_folders = parents
        name = f"titan_rl_sandbox_{os.getpid()}_{next(cls._names)}"
        cgroup = cls(kind, [p / name for p in parent_folders])
        try:
            for folder in cgroup.folders:
                folder.mkdir()
            cgroup._write_limits(limits)
        except OSError:  # not ours to write after all: per-process limits, said in the result
            cgroup.remove()
            return None
        return cgroup

    def _file(self, name: str) -> Path:
        """The file ``name`` in whichever of this cgroup's folders holds it."""
        for folder in self.folders:
            if (folder / name).exists():
                return folder / name
        raise FileNotFoundError(name)

    def _write_limits(self, limits: SandboxLimits) -> None:
        pids = str(limits.max_processes + _SUPERVISOR_TASKS)
        memory = str(limits.memory_bytes)
        if self.kind == "cgroup2":
            settings = [("memory.max", memory), ("memory.swap.max", "0"), ("pids.max", pids)]
        else:  # v1: the memory+swap limit exists only with swap accounting on
            settings = [
                ("memory.limit_in_bytes", memory),
                ("memory.memsw.limit_in_bytes", memory),
                ("pids.max", pids),
            ]
        for name, value in settings:
            with contextlib.suppress(FileNotFoundError):
                self._file(name).write_text(value)

    def oom_kills(self) -> int:
        """Processes of this run the OOM killer ended."""
        name = "memory.events" if self.kind == "cgroup2" else "memory.oom_control"
        for line in self._file(name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.kind == "cgroup2" else "memory.max_usage_in_bytes"
        try:
            return int(self._file(name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def remove(self) -> None:
        """Kill whatever is left in the cgroup (``isolation="none"`` escapees), then remove it."""
        for folder in self.folders:
            for _ in range(200):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                for pid in (folder / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.005)


@functools.cache
def _writable_cgroup_parents() -> tuple[str, list[Path]] | None:
    """This process's cgroup folders where a child with memory and pids limits can be made."""
    mounts: dict[str, Path] = {}  # "cgroup2" or a v1 controller -> mount point
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "cgroup2":
                mounts.setdefault("cgroup2", Path(fields[4]))
            elif fstype == "cgroup":
                for option in fields[-1].split(","):
                    mounts.setdefault(option, Path(fields[4]))
    own: dict[str, str] = {}  # "" (v2) or a v1 controller -> this process's cgroup path
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path.lstrip("/")
    if "cgroup2" in mounts and "" in own:
        folder = mounts["cgroup2"] / own[""]
        with contextlib.suppress(OSError):
            enabled = set((folder / "cgroup.subtree_control").read_text().split())
            if {"memory", "pids"} <= enabled and os.access(folder, os.W_OK):
                _remove_stale_cgroups([folder])
                return "cgroup2", [folder]
    if "memory" in mounts and "pids" in mounts and "memory" in own and "pids" in own:
        folders = [mounts[c] / own[c] for c in ("memory", "pids")]
        if all(os.access(f, os.W_OK) for f in folders):
            _remove_stale_cgroups(folders)
            return "cgroup1", folders
    return None


def _remove_stale_cgroups(parents: list[Path]) -> None:
    """Remove the empty cgroups of runs whose trainer died before it could (kill -9)."""
    for parent in parents:
        for folder in parent.glob("titan_rl_sandbox_*_*"):
            pid = int(folder.name.split("_")[-2])
            if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    folder.rmdir()
