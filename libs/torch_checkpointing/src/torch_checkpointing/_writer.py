"""Background writing: the job a writer runs, completeness, retention, and the writer process.

Imports no torch: in ``async_mode="process"`` this module is the whole writer process (it
starts in well under a second and holds only the shared staging buffers).

Commit protocol, per rank and per save, with no collective:

1. each data file is written under a temporary name, then renamed to its final name;
2. the rank's done-marker (``done-<rank>.json``: every file it wrote, with sizes and per-block
   XXH3-64 digests) is written the same way, after its data files;
3. rank 0 then writes ``manifest.json`` (the global layout) the same way.

A checkpoint folder is complete exactly when ``manifest.json`` and the done-marker of every
rank it lists are present. Folders are unique per save attempt, so stale files of a crashed
run can never make a new attempt look complete.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import secrets
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import _format as fmt
from ._errors import CheckpointWriteError, CorruptCheckpointError

# ------------------------------------------------------------------------------ the job


def _write_small(storage: Any, path: str, data: bytes, tag: str) -> None:
    tmp = fmt.tmp_name(path, tag)
    try:
        storage.write(tmp, [data])
        storage.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            storage.delete(tmp)
        raise


def execute_job(storage: Any, job: dict[str, Any], buffer: Callable[[int], memoryview]) -> None:
    """Write one rank's part of one checkpoint: data files, done-marker, manifest (rank 0)."""
    folder = job["dir"]
    tag = f"{job['id']}-{secrets.token_hex(4)}"
    block = job["block_size"]
    files: dict[str, Any] = {}
    current = folder
    try:
        for f in job["files"]:
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
        current = f"{folder}/{fmt.marker_file(job['rank'])}"
        _write_small(storage, current, fmt.dump_checked(marker), tag)
        if job.get("manifest") is not None:
            current = f"{folder}/{fmt.MANIFEST}"
            _write_small(storage, current, job["manifest"], tag)
    except CheckpointWriteError:
        raise
    except BaseException as e:
        raise CheckpointWriteError(
            f"saving step {job['step']} failed while writing {current!r} to {storage!r}: "
            f"{type(e).__name__}: {e}. That checkpoint is incomplete (never listed by "
            "latest_step()); earlier checkpoints are untouched."
        ) from e


# ------------------------------------------------------------------ completeness, listing


def read_manifest(storage: Any, folder: str) -> dict[str, Any]:
    path = f"{folder}/{fmt.MANIFEST}"
    return fmt.load_checked(storage.read(path), path)


def complete_manifest(storage: Any, folder: str) -> dict[str, Any] | None:
    """The manifest of ``folder`` when it is a complete checkpoint, else ``None``."""
    names = set(storage.list(folder))
    if fmt.MANIFEST not in names:
        return None
    try:
        manifest = read_manifest(storage, folder)
    except (CorruptCheckpointError, FileNotFoundError, EOFError):
        return None
    world = manifest.get("world_size")
    if not isinstance(world, int) or world < 1:
        return None
    if all(fmt.marker_file(r) in names for r in range(world)):
        return manifest
    return None


def list_attempts(storage: Any) -> list[tuple[int, str, int, str]]:
    """Every checkpoint folder under the root as (step, nonce, seq, name), oldest step first."""
    found = []
    for name in storage.list(""):
        parsed = fmt.parse_step_dir(name)
        if parsed is not None:
            found.append((*parsed, name))
    return sorted(found)


def delete_checkpoint(storage: Any, folder: str) -> None:
    """Delete ``folder``, manifest first, so it stops counting as complete before anything else
    disappears."""
    with contextlib.suppress(FileNotFoundError):
        storage.delete(f"{folder}/{fmt.MANIFEST}")
    storage.delete(folder)


def wait_complete(storage: Any, folder: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        if complete_manifest(storage, folder) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def apply_retention(storage: Any, keep_last: int, own_nonces: list[str], seq: int) -> list[str]:
    """Delete what ``keep_last`` no longer keeps; returns the folders deleted.

    Kept: the ``keep_last`` newest complete checkpoints (by step, then by write time).
    Deleted: older complete ones and duplicate attempts of a kept step; incomplete attempts of
    this run that are older in queue order than ``seq`` (failed saves); incomplete attempts of
    other runs at or below the newest complete step (leftovers of crashes).
    """
    attempts = list_attempts(storage)
    complete: list[tuple[int, float, str]] = []
    incomplete: list[tuple[int, str, int, str]] = []
    for step, nonce, s, name in attempts:
        manifest = complete_manifest(storage, name)
        if manifest is None:
            incomplete.append((step, nonce, s, name))
        else:
            complete.append((step, float(manifest.get("time", 0.0)), name))
    if not complete:
        return []
    complete.sort()
    newest_by_step: dict[int, tuple[float, str]] = {}
    for step, t, name in complete:
        newest_by_step[step] = (t, name)
    keep_steps = sorted(newest_by_step)[-keep_last:]
    keep = {newest_by_step[s][1] for s in keep_steps}
    newest_step = complete[-1][0]
    doomed = [name for _, _, name in complete if name not in keep]
    for step, nonce, s, name in incomplete:
        if nonce in own_nonces:
            if s < seq:
                doomed.append(name)
        elif step <= newest_step:
            doomed.append(name)
    for name in doomed:
        delete_checkpoint(storage, name)
    return doomed


def run_retention(storage: Any, spec: dict[str, Any]) -> None:
    if wait_complete(storage, spec["dir"], spec["wait_s"]):
        apply_retention(storage, spec["keep_last"], spec["own_nonces"], spec["seq"])


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
            os._exit(3)  # the trainer died: die with it rather than write as an orphan


def main() -> None:
    """Entry point of the writer process: ``argv = [fd of the socket, parent pid]``."""
    fd, ppid = int(sys.argv[1]), int(sys.argv[2])
    sock = socket.socket(fileno=fd)
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    buffers: dict[int, mmap.mmap] = {}
    storage: Any = None
    while True:
        msg = _recv(sock)
        if msg is None:
            os._exit(0)
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
                execute_job(storage, msg["job"], lambda i: memoryview(buffers[i]))
                reply = {"ok": True}
            elif op == "retain":
                run_retention(storage, msg["spec"])
                reply = {"ok": True}
            elif op == "exit":
                _send(sock, {"ok": True})
                os._exit(0)
            else:  # pragma: no cover - our own protocol
                raise ValueError(f"unknown writer op {op!r}")
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
