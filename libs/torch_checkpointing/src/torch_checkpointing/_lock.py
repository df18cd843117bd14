"""One live manager per checkpoint root: a lock per rank, naming its holder.

Two managers saving under one root would each apply retention to the other's checkpoints and
interleave their saves. Each rank of a manager therefore holds the lock ``.lock-<rank>.json``
of the root while it is open; a second manager's rank with the same number fails with a
``CheckpointLockedError`` naming the holder (pid, host, start time, rank).

On a local or network filesystem (``FileSystemStorage``) the lock is an ``flock`` on that
file, which stays in the root once created. The kernel releases it when the holder dies, so a
lock left by a crashed process is simply taken over (the writer process inherits the
descriptor: an orphaned writer still finishing a file keeps the root locked until it exits).
Opening a manager writes nothing: the holder writes who it is into the file at its first save
(and empties it on close); before that, a contender finds the holder's pid in the kernel's
lock table (``/proc/locks``, same host). A file left non-empty by a holder that is gone tells
the next manager it takes over from a crash.

Other storages have no such primitive: there the lock file is written through the storage on
open and deleted on close, and judged stale only when its holder ran on this host and is gone
(another host's holder cannot be checked: the error says which file to delete once that job
is known to be dead).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
import warnings
from typing import Any

from . import _format as fmt
from ._errors import CheckpointError, CheckpointLockedError, CheckpointWarning
from .storage import FileSystemStorage, PrefixedStorage, Storage

_held_tokens: set[str] = set()  # locks held by managers of this process (generic storages)
_held_fds: set[int] = set()  # flock descriptors held by managers of this process
_ORPHAN_WAIT_S = 5.0  # how long a dead holder's writer process may keep an flock


def _drop_inherited_locks() -> None:
    # A forked child (a data-loader worker) must not keep its parent's roots locked; closing
    # its copies of the descriptors leaves the parent's locks in place.
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()
    _held_tokens.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _local_path(storage: Storage, rel: str) -> str | None:
    """The OS path of ``rel`` when ``storage`` is a local folder (flock works there)."""
    if isinstance(storage, PrefixedStorage):
        return _local_path(storage.inner, f"{storage.prefix}/{rel}" if storage.prefix else rel)
    if isinstance(storage, FileSystemStorage):
        return storage.full_path(rel)
    return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool | None:
    """Whether the holder still runs: True / False, or None when this host cannot tell."""
    if holder.get("host") != socket.gethostname() or holder.get("boot_id") != _boot_id():
        return None if holder.get("host") != socket.gethostname() else False
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return "token" not in holder or holder["token"] in _held_tokens
    start = _proc_start(pid)
    return start is not None and start == holder.get("proc_start")


def _kernel_holder(fd: int) -> dict[str, Any]:
    """The process holding an flock on ``fd``'s file, from the kernel's lock table."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {}
    for row in rows:
        if len(row) >= 6 and row[1] == "FLOCK" and row[5] == ident and row[4].isdigit():
            pid = int(row[4])
            holder: dict[str, Any] = {
                "pid": pid,
                "host": socket.gethostname(),
                "boot_id": _boot_id(),
                "proc_start": _proc_start(pid),
            }
            start = holder["proc_start"]
            if start is not None:
                holder["time"] = _boot_time() + start / os.sysconf("SC_CLK_TCK")
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as c:
                holder["argv"] = c.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            return holder
    return {}


def _boot_time() -> float:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def describe(holder: dict[str, Any]) -> str:
    since = holder.get("time")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
        if isinstance(since, int | float)
        else "an unknown time"
    )
    rank = f", rank {holder['rank']} of {holder.get('world_size')}" if "rank" in holder else ""
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')!r}, started {when}{rank} "
        f"({holder.get('argv', '?')})"
    )


def _parse(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data)
    except Exception:  # garbage (deep nesting: RecursionError) reads as no holder
        return {}
    return holder if isinstance(holder, dict) else {}


class RootLock:
    """This rank's exclusive use of a checkpoint root (see the module docstring)."""

    def __init__(self, storage: Storage, rank: int, world_size: int) -> None:
        self.storage = storage
        self.name = fmt.lock_file(rank)
        self.path = _local_path(storage, self.name)
        self.fd: int | None = None
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "proc_start": _proc_start(os.getpid()),
            "time": time.time(),
            "rank": rank,
            "world_size": world_size,
            "argv": " ".join(sys.argv[:3])[:200],
            "token": secrets.token_hex(8),
        }
        self.held = False
        self._announced = False

    def __repr__(self) -> str:
        return f"RootLock({self.storage!r}/{self.name})"

    def acquire(self) -> None:
        if self.path is not None:
            self._acquire_flock()
        else:
            self._acquire_generic()
        self.held = True
        _held_tokens.add(self.holder["token"])

    def announce(self) -> None:
        """Write who holds the lock into the lock file (at the first save: opening a manager
        writes nothing)."""
        if self.fd in _held_fds and not self._announced:
            data = json.dumps(self.holder).encode()
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            self._announced = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _held_tokens.discard(self.holder["token"])
        if self.fd is not None:
            if self.fd in _held_fds:  # else: a forked child's copy, already closed
                if self._announced:  # an empty file: closed cleanly
                    with contextlib.suppress(OSError):
                        os.ftruncate(self.fd, 0)
                _held_fds.discard(self.fd)
                # Unlock explicitly: a child forked a moment ago shares this open file and
                # may not have run its after-fork hook yet; closing alone would leave the
                # root locked until it does.
                with contextlib.suppress(OSError):
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
            self.fd = None
            return
        with contextlib.suppress(Exception):
            if _parse(self.storage.read(self.name)).get("token") == self.holder["token"]:
                self.storage.delete(self.name)

    # -- filesystem: flock
    def _acquire_flock(self) -> None:
        assert self.path is not None
        deadline = time.monotonic() + _ORPHAN_WAIT_S
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise self._unwritable(e) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _parse(os.pread(fd, 1 << 16, 0))
                if _alive(holder) is not True:  # not written yet, or a previous holder's
                    holder = _kernel_holder(fd) or holder
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(f"cannot lock {self.path}: {e}") from e
                # A holder that died may leave its writer process finishing a file for a
                # moment (it exits within 0.2 s of its parent): wait for it, briefly.
                if _alive(holder) is False and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise self._locked(holder, self.path) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # someone deleted the file meanwhile: lock the one at the path now
                os.close(fd)
                continue
            self.fd = fd
            _held_fds.add(fd)
            previous = _parse(os.pread(fd, 1 << 16, 0))
            if previous:  # a holder that saved and never closed
                self._stale(previous)
            return

    # -- any storage: a lock file written through it
    def _acquire_generic(self) -> None:
        try:
            previous = (
                _parse(self.storage.read(self.name)) if self.storage.exists(self.name) else {}
            )
        except FileNotFoundError:
            previous = {}
        if previous and _alive(previous) is not False:
            raise self._locked(previous, f"{self.storage!r}/{self.name}")
        try:
            self.storage.write(self.name, [json.dumps(self.holder).encode()])
            mine = _parse(self.storage.read(self.name)).get("token") == self.holder["token"]
        except OSError as e:
            raise self._unwritable(e) from e
        if not mine:
            raise CheckpointLockedError(
                f"{self.storage!r}: another manager took the lock {self.name} at the same time",
                _parse(self.storage.read(self.name)),
            )
        if previous:
            self._stale(previous)

    # -- messages
    def _locked(self, holder: dict[str, Any], where: str) -> CheckpointLockedError:
        alive = _alive(holder)
        hint = (
            "close that manager first, or use another root (a manager that only loads can "
            "pass read_only=True)"
        )
        if alive is None:
            hint += (
                f"; it runs on another host, so this host cannot tell whether it is still "
                f"alive: if that job is gone, delete {where}"
            )
        return CheckpointLockedError(
            f"CheckpointManager: the checkpoint root {self.storage!r} is in use by another live "
            f"manager: {describe(holder) if holder else 'unknown holder'} holds {where}. Two "
            f"managers saving to one root would delete each other's checkpoints; {hint}",
            holder,
        )

    def _unwritable(self, e: OSError) -> CheckpointError:
        return CheckpointError(
            f"CheckpointManager: cannot create the lock file {self.name} in the checkpoint root "
            f"{self.storage!r} ({e.strerror or e}): a manager that saves needs a writable root; "
            "pass read_only=True to only load from it"
        )

    def _stale(self, previous: dict[str, Any]) -> None:
        warnings.warn(
            f"torch_checkpointing: took over the lock of {self.storage!r} left by "
            f"{describe(previous)}, which is no longer running (it was killed or crashed "
            "without closing its manager)",
            CheckpointWarning,
            stacklevel=4,
        )
