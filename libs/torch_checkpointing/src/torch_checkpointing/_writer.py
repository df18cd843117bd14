"""Background writing: the job a writer runs, the writer process, and the thread driving it.

Imports no torch: in ``async_mode="process"`` this module (with ``_format``, ``_retention``
and ``storage``) is the whole writer process, which starts in well under a second and holds
only the shared staging buffers. ``BackgroundWriter`` is its parent side: one thread that runs
queued tasks in order, itself (``async_mode="thread"``) or through that process.

Commit protocol, per rank and per save, with no collective:

1. each data file is written under a temporary name, then renamed to its final name;
2. the rank's done-marker (``done-<rank>.json``: every file it wrote, with sizes and per-block
   XXH3-64 digests) is written the same way, after its data files;
3. rank 0 then writes ``manifest.json`` (the global layout) the same way.

A checkpoint folder is complete exactly when ``manifest.json`` and the done-marker of every
rank it lists are present. Folders are unique per save attempt, so stale files of a crashed
run can never make a new attempt look complete.

A writer process whose parent is gone (killed, crashed) abandons the save it is writing: it
commits nothing more (the checks before each file and before the done-marker see the parent
gone) and exits silently with status ``ORPHANED_EXIT``, whether it notices first through its
parent-watching thread, a closed socket, or a reply that can no longer be sent. It ignores
SIGINT: a Ctrl-C in the terminal reaches the whole process group, and the trainer, not its
writer, decides what happens to queued saves.
"""

from __future__ import annotations

import collections
import contextlib
import json
import mmap
import os
import pickle
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _format as fmt
from ._errors import CheckpointWarning, CheckpointWriteError
from ._retention import run_retention

if TYPE_CHECKING:  # pragma: no cover
    from .storage import Storage

# ------------------------------------------------------------------------------ the job

ORPHANED_EXIT = 3
"""Exit status of a writer process that abandoned its work because its parent is gone."""


class _Orphaned(Exception):
    """The writer process's parent is gone: stop before committing anything more."""


def _write_small(storage: Storage, path: str, data: bytes, tag: str) -> None:
    tmp = fmt.tmp_name(path, tag)
    try:
        storage.write(tmp, [data])
        storage.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            storage.delete(tmp)
        raise


def execute_job(
    storage: Storage,
    job: dict[str, Any],
    buffer: Callable[[int], memoryview],
    alive: Callable[[], bool] | None = None,
) -> None:
    """Write one rank's part of one checkpoint: data files, done-marker, manifest (rank 0).

    ``alive`` (the writer process's "is my parent still there?") is asked before each file: a
    save whose trainer is gone is abandoned (``_Orphaned``) before its done-marker, so it never
    completes behind the back of a run that no longer exists.
    """

    def check() -> None:
        if alive is not None and not alive():
            raise _Orphaned

    folder = job["dir"]
    tag = f"{job['id']}-{secrets.token_hex(4)}"
    block = job["block_size"]
    files: dict[str, Any] = {}
    current = folder
    try:
        for f in job["files"]:
            check()
            path = f"{folder}/{f['name']}"
            current = path
            data = buffer(f["buffer"])[f["offset"] : f["offset"] + f["size"]]
            tmp = fmt.tmp_name(path, tag)
            try:
                size, crcs = fmt.write_checksummed(storage, tmp, [f["header"], data], block)
                storage.rename(tmp, path)
            except BaseException:
                with contextlib.suppress(Exception):
                    storage.delete(tmp)
                raise
            files[f["name"]] = {
                "item": f["item"],
                "size": size,
                "data_start": len(f["header"]),
                "block_size": block,
                "block_xxh3_64": crcs,
                "chunks": f["chunks"],
                "tree": f["tree"],
            }
        marker = dict(job["marker"])
        marker["files"] = files
        check()  # the commit point of this rank's part
        current = f"{folder}/{fmt.marker_file(job['rank'])}"
        _write_small(storage, current, fmt.dump_checked(marker), tag)
        if job.get("manifest") is not None:
            current = f"{folder}/{fmt.MANIFEST}"
            _write_small(storage, current, job["manifest"], tag)
    except (CheckpointWriteError, _Orphaned):
        raise
    except BaseException as e:
        raise CheckpointWriteError(
            f"saving step {job['step']} failed while writing {current!r} to {storage!r}: "
            f"{type(e).__name__}: {e}. That checkpoint is incomplete (never listed by "
            "latest_step()); earlier checkpoints are untouched."
        ) from e


# --------------------------------------------------------------------- writer process


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    head = _recv_exact(sock, 8)
    if head is None:
        return None
    (n,) = struct.unpack("<Q", head)
    data = _recv_exact(sock, n)
    if data is None:
        return None
    return pickle.loads(data)  # our own parent process, over a private socketpair


def send_message(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    _send(sock, obj)
    if fds:
        socket.send_fds(sock, [b"F"], fds)


def recv_message(sock: socket.socket) -> Any:
    return _recv(sock)


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(0.2)
        if os.getppid() != ppid:
            os._exit(ORPHANED_EXIT)  # the trainer died: die with it rather than write as an orphan


def main() -> None:
    """Entry point of the writer process: ``argv = [fd of the socket, parent pid]``."""
    fd, ppid = int(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    try:
        _serve(sock, lambda: os.getppid() == ppid)
    except (_Orphaned, OSError):
        # The parent is gone (a socket error here is its end closing: EPIPE, ECONNRESET):
        # there is no one left to report to, so no traceback either.
        os._exit(ORPHANED_EXIT)
    os._exit(0)


def _serve(sock: socket.socket, alive: Callable[[], bool]) -> None:
    """Answer the parent's requests until it says ``exit``; ``_Orphaned`` once it is gone."""
    buffers: dict[int, mmap.mmap] = {}
    storage: Storage | None = None
    while True:
        msg = _recv(sock)
        if msg is None:  # EOF without an "exit": the parent died
            raise _Orphaned
        op = msg["op"]
        try:
            if op == "init":
                storage = pickle.loads(msg["storage"])
                reply: dict[str, Any] = {"ok": True}
            elif op == "buffer":
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                buffers[msg["id"]] = mmap.mmap(fds[0], msg["size"])
                os.close(fds[0])
                continue
            elif op == "free":
                mm = buffers.pop(msg["id"], None)
                if mm is not None:
                    mm.close()
                continue
            elif op == "job":
                if storage is None:
                    raise RuntimeError("writer process: a job arrived before init")
                execute_job(storage, msg["job"], lambda i: memoryview(buffers[i]), alive)
                reply = {"ok": True}
            elif op == "retain":
                if not alive():
                    raise _Orphaned
                if storage is None:
                    raise RuntimeError("writer process: a retention arrived before init")
                result = run_retention(storage, msg["spec"])
                reply = {"ok": True, "damaged": result.damaged}
            elif op == "exit":
                _send(sock, {"ok": True})
                return
            else:  # pragma: no cover - our own protocol
                raise ValueError(f"unknown writer op {op!r}")
        except _Orphaned:
            raise
        except BaseException as e:
            reply = {
                "ok": False,
                "error": e if _picklable(e) else None,
                "message": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        _send(sock, reply)


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return False
    return True


def check_process_safe(storage: Storage) -> None:
    """Raise unless a writer process can use ``storage`` (``async_mode="process"``)."""
    if not storage.process_safe:
        raise ValueError(
            f"CheckpointManager: {storage!r} is not visible from another process (an "
            "in-memory filesystem?); use async_mode='thread' or 'off'"
        )
    try:
        pickle.loads(pickle.dumps(storage))
    except Exception as e:
        raise ValueError(
            f"CheckpointManager: async_mode='process' sends the storage to a writer "
            f"process, but {storage!r} cannot be pickled ({e}); use async_mode='thread'"
        ) from e
    if type(storage).__module__ == "__main__":
        raise ValueError(
            "CheckpointManager: async_mode='process' needs a storage class importable "
            f"by the writer process, but {type(storage).__qualname__} is defined in "
            "__main__; move it to a module or use async_mode='thread'"
        )


def child_command() -> list[str]:
    code = (
        "import json, os, sys; "
        "sys.path[:0] = json.loads(os.environ.pop('TORCH_CHECKPOINTING_SYS_PATH', '[]')); "
        "from torch_checkpointing._writer import main; main()"
    )
    return [sys.executable, "-c", code]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_CHECKPOINTING_SYS_PATH"] = json.dumps([p for p in sys.path if p])
    return env


# ------------------------------------------------------------------- the parent's thread


class BackgroundWriter:
    """Runs queued tasks in order on one thread; in process mode that thread drives a
    torch-free writer process over a socket, passing staging buffers as memfd descriptors.

    Tasks: ``("job", job, buffer, events, done)`` writes one rank's part of a save and calls
    ``done(error)``; ``("retain", spec)`` applies retention and hands the damaged folders it
    saw to ``on_damaged``; ``("free", buffer)`` releases a staging buffer. ``inherit_fds`` stay
    open in the writer process for as long as it lives (the root's lock).
    """

    def __init__(
        self,
        mode: str,
        storage: Storage,
        *,
        on_damaged: Callable[[list[tuple[str, str]]], None],
        inherit_fds: Sequence[int] = (),
    ) -> None:
        self.mode = mode
        self.storage = storage
        self._on_damaged = on_damaged
        self._inherit = list(inherit_fds)
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._registered: set[int] = set()
        self._stopping = False
        self._failed: set[str] = set()  # folders of this rank's failed jobs
        self._abandon = threading.Event()  # retention stops waiting for peers
        self._retaining = False  # the task running is a retention

    def submit(self, task: tuple) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="torch_checkpointing-writer", daemon=True
                )
                self._thread.start()
            self._queue.append(task)
            self._cv.notify_all()

    def wait_idle(self) -> None:
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait()

    def close(self, *, abandon_retention: bool = False) -> None:
        """Finish the queued tasks and stop. ``abandon_retention``: a retention still waiting
        for other ranks to complete their parts stops waiting and deletes nothing (a peer
        that died never completes its part; the next save's retention catches up)."""
        if abandon_retention:
            with self._cv:
                self._abandon.set()
                self._queue = collections.deque(t for t in self._queue if t[0] != "retain")
                if self._retaining and self.mode == "process" and self._proc is not None:
                    self._proc.kill()  # the writer process is only waiting or deleting
        self.wait_idle()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._stop_proc()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
                self._busy = True
            try:
                self._do(task)
            except BaseException as e:  # pragma: no cover - _do reports per task
                warnings.warn(f"torch_checkpointing writer: {e!r}", CheckpointWarning, stacklevel=1)
            finally:
                task = None  # a finished job's callback must not keep its manager alive
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _do(self, task: tuple) -> None:
        kind = task[0]
        if kind == "job":
            _, job, buffer, events, done = task
            error: BaseException | None = None
            try:
                for ev in events:
                    ev.synchronize()
                self._run_job(job, buffer)
            except BaseException as e:
                error = e
                self._failed.add(job["dir"])
            done(error)
        elif kind == "retain":
            _, spec = task
            if spec["dir"] in self._failed:  # it will never complete: nothing to wait for
                return
            try:
                with self._cv:
                    if self._abandon.is_set():
                        return
                    self._retaining = True
                if self.mode == "process":
                    damaged = self._call({"op": "retain", "spec": spec})["damaged"]
                else:
                    damaged = run_retention(self.storage, spec, self._abandon.is_set).damaged
            except BaseException as e:
                if self._abandon.is_set():  # the writer process was stopped on purpose
                    return
                warnings.warn(
                    f"torch_checkpointing: keep_last retention failed (nothing more was "
                    f"deleted): {e}",
                    CheckpointWarning,
                    stacklevel=1,
                )
            else:
                if damaged:
                    self._on_damaged(damaged)
            finally:
                self._retaining = False
        elif kind == "free":
            _, buffer = task
            if buffer.id in self._registered and self._sock is not None:
                with contextlib.suppress(OSError):
                    send_message(self._sock, {"op": "free", "id": buffer.id})
                self._registered.discard(buffer.id)
            buffer.close()

    def _run_job(self, job: dict[str, Any], buffer: Any) -> None:
        if self.mode != "process":
            execute_job(self.storage, job, lambda _i: buffer.view)
            return
        self._ensure_proc()
        assert self._sock is not None
        if buffer.id not in self._registered:
            send_message(
                self._sock, {"op": "buffer", "id": buffer.id, "size": buffer.size}, [buffer.fd]
            )
            self._registered.add(buffer.id)
        self._call({"op": "job", "job": job})

    def _ensure_proc(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop_proc()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [*child_command(), str(child.fileno()), str(os.getpid())],
                pass_fds=[child.fileno(), *self._inherit],
                env=child_env(),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self._sock = parent
        self._registered = set()
        self._call({"op": "init", "storage": pickle.dumps(self.storage)})

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self._sock is not None
        try:
            send_message(self._sock, msg)
            reply = recv_message(self._sock)
        except OSError:
            reply = None
        if reply is None:
            code = self._proc.poll() if self._proc is not None else None
            self._stop_proc()
            raise CheckpointWriteError(
                f"the checkpoint writer process exited unexpectedly (exit code {code}); the "
                "save it was writing is incomplete and earlier checkpoints are untouched"
            )
        if not reply["ok"]:
            if reply.get("error") is not None:
                raise reply["error"]
            raise CheckpointWriteError(f"{reply['message']}\n{reply['traceback']}")
        return reply

    def _stop_proc(self) -> None:
        if self._sock is not None:
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(OSError):
                    send_message(self._sock, {"op": "exit"})
                    recv_message(self._sock)
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._registered = set()
