"""``CheckpointManager``: async distributed checkpoints with one metadata exchange.

Save, per rank:

1. flatten the state (``state_dict()`` of stateful objects) into tensor entries and a JSON
   skeleton of everything else;
2. the first time a *global layout* (items, keys, kinds, dtypes, global shapes, DTensor
   meshes and placements) is seen: ONE ``allgather`` of a fixed-size int64 record (layout
   digest, a fresh nonce from rank 0, bytes each rank writes anyway) that decides which rank
   writes each replicated tensor. Never again for that layout;
3. copy this rank's chunks into a reused staging buffer (pinned and asynchronous for CUDA
   tensors) and return a ``SaveHandle``: the caller may now mutate its tensors;
4. a background writer (a thread, or a torch-free process sharing the buffer) writes one
   safetensors file per item, then this rank's done-marker, then (rank 0) the manifest.

Load reads the manifest and every rank's done-marker, matches the target's entries, and
fills each target box (plain tensor, DTensor shard, sharded-protocol chunk) from the
overlapping stored chunks, reading only the checksum blocks that hold them.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import json
import math
import os
import pickle
import secrets
import socket
import subprocess
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _format as fmt
from . import _reshard as rs
from . import _tree as tr
from . import _writer as wr
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    StateMismatchError,
)
from ._staging import StagingBuffer
from .storage import FileSystemStorage, PrefixedStorage

__all__ = ["ASYNC_MODES", "CheckpointManager", "SaveHandle"]

ASYNC_MODES = ("process", "thread", "off")
_FORMAT_VERSION = 1
_RETENTION_WAIT_S = 120.0
_DATA_ALIGN = 4096


# ------------------------------------------------------------------------------ handles


class SaveHandle:
    """The pending write of one save on this rank.

    ``wait()`` returns once this rank's files, done-marker (and, on rank 0, the manifest) are
    written, and raises if writing failed. The checkpoint is complete, and listed by
    ``latest_step()``, once every rank's part is.
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._reported = False

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._event.is_set() else "pending"
        return f"SaveHandle(step={self.step}, path={self.path!r}, {state})"

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still writing after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()


# ------------------------------------------------------------------------------- plans


@dataclass(slots=True)
class _GlobalPlan:
    digest: bytes
    nonce: str
    writer_of: dict[tuple[str, str], int]
    manifest_items: dict[str, Any]


@dataclass(slots=True)
class _FilePlan:
    item: str
    name: str
    offset: int  # in the staging buffer
    size: int
    chunks: list[list[Any]]  # [key, offsets, shape, dtype, rel_start, rel_end]
    tree: bool
    table_json: str  # safetensors tensor entries, pre-serialised
    meta_chunks_json: str


@dataclass(slots=True)
class _Slot:
    buffer: StagingBuffer
    views: dict[tuple[str, str, tuple[int, ...]], torch.Tensor]
    busy: bool = False
    retired: bool = False


@dataclass(slots=True)
class _LocalPlan:
    key: tuple
    files: list[_FilePlan]
    total: int
    slots: list[_Slot] = field(default_factory=list)


# --------------------------------------------------------------------- the writer thread


class _BackgroundWriter:
    """Runs queued tasks in order on one thread; in process mode that thread drives a
    torch-free writer process over a socket, passing staging buffers as memfd descriptors."""

    def __init__(self, mode: str, storage: Any) -> None:
        self.mode = mode
        self.storage = storage
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._registered: set[int] = set()
        self._stopping = False

    # -- queue
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

    def close(self) -> None:
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
                warnings.warn(f"torch_checkpointing writer: {e!r}", stacklevel=1)
            finally:
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
            done(error)
        elif kind == "retain":
            _, spec = task
            try:
                if self.mode == "process":
                    self._call({"op": "retain", "spec": spec})
                else:
                    wr.run_retention(self.storage, spec)
            except BaseException as e:
                warnings.warn(f"torch_checkpointing: keep_last retention failed: {e}", stacklevel=1)
        elif kind == "free":
            _, buffer = task
            if buffer.id in self._registered and self._sock is not None:
                with contextlib.suppress(OSError):
                    wr.send_message(self._sock, {"op": "free", "id": buffer.id})
                self._registered.discard(buffer.id)
            buffer.close()

    def _run_job(self, job: dict[str, Any], buffer: StagingBuffer) -> None:
        if self.mode != "process":
            wr.execute_job(self.storage, job, lambda _i: buffer.view)
            return
        self._ensure_proc()
        assert self._sock is not None
        if buffer.id not in self._registered:
            wr.send_message(
                self._sock, {"op": "buffer", "id": buffer.id, "size": buffer.size}, [buffer.fd]
            )
            self._registered.add(buffer.id)
        self._call({"op": "job", "job": job})

    # -- process mode
    def _ensure_proc(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop_proc()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [*wr.child_command(), str(child.fileno()), str(os.getpid())],
                pass_fds=[child.fileno()],
                env=wr.child_env(),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self._sock = parent
        self._registered = set()
        self._call({"op": "init", "storage": pickle.dumps(self.storage)})

    def _call(self, msg: dict[str, Any]) -> None:
        assert self._sock is not None
        try:
            wr.send_message(self._sock, msg)
            reply = wr.recv_message(self._sock)
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

    def _stop_proc(self) -> None:
        if self._sock is not None:
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(OSError):
                    wr.send_message(self._sock, {"op": "exit"})
                    wr.recv_message(self._sock)
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


# ------------------------------------------------------------------------- collectives


def _pg_device(pg: Any) -> torch.device:
    try:
        import torch.distributed as dist

        backend = str(dist.get_backend(pg))
    except Exception:
        try:
            backend = str(pg.name())
        except Exception:
            backend = "gloo"
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allgather_int64(pg: Any, values: list[int]) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64, device=_pg_device(pg))
    out = [torch.empty_like(t) for _ in range(pg.size())]
    pg.allgather([out], [t]).wait()
    return [o.cpu().tolist() for o in out]


def _allgather_bytes(pg: Any, data: bytes) -> list[bytes]:
    """Variable-size exchange (two collectives); used only to explain a layout mismatch."""
    sizes = _allgather_int64(pg, [len(data)])
    n = max(s[0] for s in sizes)
    dev = _pg_device(pg)
    t = torch.zeros(n, dtype=torch.uint8, device=dev)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    out = [torch.empty_like(t) for _ in range(pg.size())]
    pg.allgather([out], [t]).wait()
    return [bytes(o.cpu()[: s[0]].tolist()) for o, s in zip(out, sizes, strict=True)]


# ------------------------------------------------------------------------------ manager

_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # pending saves finish before the interpreter exits
    for m in list(_live):
        with contextlib.suppress(Exception):
            m.close()


class CheckpointManager:
    """Async distributed checkpoints under ``root``.

    Args:
        root: folder of the checkpoints (a ``FileSystemStorage`` is made for it), or, with
            ``storage=``, a sub-folder inside that storage (``None``/``""``: its root).
        storage: a ``Storage`` backend (``FileSystemStorage``, ``FsspecStorage``, your own).
        process_group: the group whose ranks save together; default: the default group when
            ``torch.distributed`` is initialised, else a single process.
        async_mode: ``"process"`` (a light writer process per rank does the I/O),
            ``"thread"`` (a writer thread), or ``"off"`` (``save`` writes before returning).
        keep_last: keep only the newest N complete checkpoints (older ones are deleted by
            rank 0 after a newer one is complete); ``None`` keeps all.
        staging_slots: staging buffers per layout (default 1). With 1, a save waits for
            the previous save's write to finish before staging; with 2, one save can be
            staged while the previous one is still being written.
        block_size: bytes per checksum block (default 1 MiB); loads read whole blocks.
        io_threads: parallel reads during ``load`` (default 8).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None,
        *,
        storage: Any = None,
        process_group: Any = None,
        async_mode: str = "process",
        keep_last: int | None = None,
        staging_slots: int = 1,
        block_size: int = fmt.DEFAULT_BLOCK_SIZE,
        io_threads: int = 8,
    ) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(
                f"CheckpointManager: async_mode must be one of {ASYNC_MODES}, got {async_mode!r}"
            )
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ValueError(
                f"CheckpointManager: keep_last must be None or an int >= 1, got {keep_last!r}"
            )
        if (
            isinstance(staging_slots, bool)
            or not isinstance(staging_slots, int)
            or not (1 <= staging_slots <= 8)
        ):
            raise ValueError(
                f"CheckpointManager: staging_slots must be an int in [1, 8], got {staging_slots!r}"
            )
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size < 4096
            or block_size & (block_size - 1)
        ):
            raise ValueError(
                f"CheckpointManager: block_size must be a power of two >= 4096, got {block_size!r}"
            )
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(
                f"CheckpointManager: io_threads must be an int >= 1, got {io_threads!r}"
            )
        if storage is None:
            if root is None:
                raise ValueError("CheckpointManager: pass root=... (a folder) or storage=...")
            storage = FileSystemStorage(root)
        else:
            for op in ("write", "read", "read_into", "size", "list", "exists", "delete", "rename"):
                if not callable(getattr(storage, op, None)):
                    raise TypeError(
                        f"CheckpointManager: storage {storage!r} lacks the Storage method {op!r}"
                    )
            if root not in (None, ""):
                storage = PrefixedStorage(storage, os.fspath(root))
        if async_mode == "process":
            if not getattr(storage, "process_safe", True):
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
        self.storage = storage
        self.async_mode = async_mode
        self.keep_last = keep_last
        self.staging_slots = staging_slots
        self.block_size = block_size
        self.io_threads = io_threads
        self._pg = self._resolve_group(process_group)
        self.rank = self._pg.rank() if self._pg is not None else 0
        self.world_size = self._pg.size() if self._pg is not None else 1
        self._lock = threading.RLock()
        self._global: _GlobalPlan | None = None
        self._local: _LocalPlan | None = None
        self._slot_cv = threading.Condition()
        self._nonces: list[str] = []
        self._seq = 0
        self._handles: list[SaveHandle] = []
        self._writer = _BackgroundWriter(async_mode, storage) if async_mode != "off" else None
        self._complete_cache: dict[str, dict[str, Any]] = {}
        self._closed = False
        self.collectives = 0  # metadata exchanges run so far (for tests and logs)
        _live.add(self)

    @staticmethod
    def _resolve_group(pg: Any) -> Any:
        if pg is not None:
            if not (callable(getattr(pg, "rank", None)) and callable(getattr(pg, "size", None))):
                raise TypeError(f"process_group must be a ProcessGroup, got {type(pg).__name__}")
            return pg
        try:
            import torch.distributed as dist
        except Exception:  # pragma: no cover
            return None
        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_group()
        return None

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.storage!r}, rank={self.rank}/{self.world_size}, "
            f"async_mode={self.async_mode!r}, keep_last={self.keep_last})"
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- errors
    def _raise_pending(self) -> None:
        with self._lock:
            failed = [h for h in self._handles if h.done() and h._error is not None]
            self._handles = [h for h in self._handles if not h.done()]
        unreported = [h for h in failed if not h._reported]
        for h in unreported:
            h._reported = True
        if unreported:
            raise unreported[0]._error  # type: ignore[misc]

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")

    # --------------------------------------------------------------------------- save
    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Stage ``state`` for ``step`` and queue its write; returns once the state is copied.

        Raises the error of an earlier save that failed since the last call, before doing
        anything. Every rank of the group must call ``save`` with the same steps in the same
        order (it is collective only the first time a layout is seen).
        """
        self._check_open()
        self._raise_pending()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"save: step must be an int >= 0, got {step!r}")
        if step >= 10**12:
            raise ValueError(f"save: step must be < 10**12, got {step}")
        _check_state(state, "save")
        with self._lock, torch.no_grad():
            flats = {item: tr.flatten(item, value) for item, value in state.items()}
            digest, summary = self._digest(flats)
            own = self._own_chunks(flats)
            if self._global is None or self._global.digest != digest:
                self._exchange(flats, digest, summary, own)
            assert self._global is not None
            chunks = own + self._replicated_chunks(flats)
            plan = self._local_plan(flats, chunks)
            slot = self._acquire_slot(plan)
            try:
                self._raise_pending()  # a save that failed while we waited for the slot
                events = self._stage(slot, chunks)
                job = self._job(step, flats, plan, slot)
            except BaseException:
                self._release_slot(slot)
                raise
            handle = SaveHandle(step, job["dir"])
            self._seq += 1

        def done(error: BaseException | None, slot: _Slot = slot) -> None:
            self._release_slot(slot)
            handle._finish(error)

        if self._writer is None:
            error = None
            try:
                wr.execute_job(self.storage, job, lambda _i: slot.buffer.view)
            except BaseException as e:
                error = e
            done(error)
            if error is not None:
                handle._reported = True
                raise error
            if self.keep_last is not None and self.rank == 0:
                try:
                    wr.run_retention(self.storage, self._retention_spec(job))
                except Exception as e:
                    warnings.warn(
                        f"torch_checkpointing: keep_last retention failed: {e}", stacklevel=2
                    )
            return handle
        with self._lock:
            self._handles.append(handle)
        self._writer.submit(("job", job, slot.buffer, events, done))
        if self.keep_last is not None and self.rank == 0:
            self._writer.submit(("retain", self._retention_spec(job)))
        return handle

    def _retention_spec(self, job: dict[str, Any]) -> dict[str, Any]:
        return {
            "dir": job["dir"],
            "keep_last": self.keep_last,
            "own_nonces": list(self._nonces),
            "seq": job["seq"],
            "wait_s": _RETENTION_WAIT_S,
        }

    def wait(self) -> None:
        """Wait until every queued save of this rank is written; raise the first failure not
        yet reported."""
        if self._writer is not None:
            self._writer.wait_idle()
        self._raise_pending()

    def close(self) -> None:
        """Wait for queued saves, stop the writer, free the staging buffers."""
        if self._closed:
            return
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self._closed = True
            _live.discard(self)
            if self._local is not None:
                for s in self._local.slots:
                    s.buffer.close()
            self._local = None
        self._raise_pending()

    # -- layout
    def _digest(self, flats: dict[str, tr.Flat]) -> tuple[bytes, list[str]]:
        lines = [f"format={_FORMAT_VERSION} world={self.world_size} block={self.block_size}"]
        for item in sorted(flats):
            flat = flats[item]
            if flat.per_rank:
                lines.append(f"item {item!r} per_rank")
                continue
            lines.append(f"item {item!r}")
            for key in sorted(flat.leaves):
                leaf = flat.leaves[key]
                line = f"  {tr.display(item, key)!r} {leaf.kind} {leaf.dtype} {list(leaf.shape)}"
                if leaf.kind == "dtensor":
                    mesh = leaf.obj.device_mesh
                    line += f" mesh={tuple(mesh.shape)} placements={tuple(leaf.obj.placements)}"
                lines.append(line)
        return hashlib.sha256("\n".join(lines).encode()).digest(), lines

    def _exchange(
        self,
        flats: dict[str, tr.Flat],
        digest: bytes,
        summary: list[str],
        own: list[tuple],
    ) -> None:
        words = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
        nonce = secrets.randbits(47) if self.rank == 0 else 0
        own_bytes = sum(c[5] for c in own)
        record = [*words, nonce, own_bytes, _FORMAT_VERSION]
        if self._pg is None:
            rows = [record]
        else:
            rows = _allgather_int64(self._pg, record)
            self.collectives += 1
        if any(r[:4] != rows[0][:4] for r in rows):
            self._explain_mismatch(rows, summary)
        nonce_hex = f"{rows[0][4]:012x}"
        loads = [r[5] for r in rows]
        replicated = sorted(
            (
                (-math.prod(leaf.shape) * fmt.DTYPES[leaf.dtype][0], item, key)
                for item, flat in flats.items()
                if not flat.per_rank
                for key, leaf in flat.leaves.items()
                if leaf.kind == "tensor"
            )
        )
        writer_of: dict[tuple[str, str], int] = {}
        for negbytes, item, key in replicated:
            r = min(range(len(loads)), key=lambda i: (loads[i], i))
            writer_of[(item, key)] = r
            loads[r] += -negbytes
        items = {}
        for item in sorted(flats):
            flat = flats[item]
            items[item] = {
                "per_rank": flat.per_rank,
                "entries": {}
                if flat.per_rank
                else {k: [lf.kind, lf.dtype, list(lf.shape)] for k, lf in flat.leaves.items()},
            }
        self._global = _GlobalPlan(digest, nonce_hex, writer_of, items)
        self._nonces.append(nonce_hex)

    def _explain_mismatch(self, rows: list[list[int]], summary: list[str]) -> None:
        differing = [r for r, row in enumerate(rows) if row[:4] != rows[0][:4]]
        detail = ""
        try:
            texts = _allgather_bytes(self._pg, "\n".join(summary).encode())
            base = set(texts[0].decode().splitlines())
            parts = []
            for r in differing[:4]:
                mine = set(texts[r].decode().splitlines())
                only_r = sorted(mine - base)[:8]
                only_0 = sorted(base - mine)[:8]
                parts.append(f"rank {r} has {only_r} where rank 0 has {only_0}")
            detail = "; ".join(parts)
        except Exception as e:  # pragma: no cover - best effort
            detail = f"(could not exchange details: {e})"
        raise CheckpointError(
            f"save: ranks {differing} see a different state layout from rank 0 (every rank "
            f"must save the same items, keys, dtypes, global shapes and placements): {detail}"
        )

    def _own_chunks(self, flats: dict[str, tr.Flat]) -> list[tuple]:
        """Chunks this rank writes whatever the exchange says: its DTensor shards (one replica
        per shard), its sharded-protocol chunks, its PerRank tensors.
        Tuples: (item, key, offsets, shape, dtype, nbytes, source tensor)."""
        out = []
        for item, flat in flats.items():
            for key, leaf in flat.leaves.items():
                isz = fmt.DTYPES[leaf.dtype][0]
                if flat.per_rank:
                    t = leaf.obj
                    out.append(
                        (item, key, (0,) * t.dim(), tuple(t.shape), leaf.dtype, t.numel() * isz, t)
                    )
                elif leaf.kind == "dtensor":
                    if not _writes_replica(leaf.obj, f"{item}/{key}"):
                        continue
                    for offsets, t in rs.local_chunks(leaf):
                        if t.numel():
                            out.append(
                                (item, key, offsets, tuple(t.shape), leaf.dtype, t.numel() * isz, t)
                            )
                elif leaf.kind == "sharded":
                    for offsets, t in rs.local_chunks(leaf):
                        if t.numel():
                            out.append(
                                (item, key, offsets, tuple(t.shape), leaf.dtype, t.numel() * isz, t)
                            )
        return out

    def _replicated_chunks(self, flats: dict[str, tr.Flat]) -> list[tuple]:
        assert self._global is not None
        out = []
        for item, flat in flats.items():
            if flat.per_rank:
                continue
            for key, leaf in flat.leaves.items():
                if leaf.kind == "tensor" and self._global.writer_of[(item, key)] == self.rank:
                    t = leaf.obj
                    isz = fmt.DTYPES[leaf.dtype][0]
                    out.append(
                        (item, key, (0,) * t.dim(), tuple(t.shape), leaf.dtype, t.numel() * isz, t)
                    )
        return out

    # -- staging
    def _local_plan(self, flats: dict[str, tr.Flat], chunks: list[tuple]) -> _LocalPlan:
        by_item: dict[str, list[tuple]] = {item: [] for item in flats}
        for c in chunks:
            by_item[c[0]].append(c)
        tree_items = {item for item, f in flats.items() if f.per_rank or self.rank == 0}
        key = tuple(
            (item, item in tree_items, tuple((c[1], c[2], c[3], c[4]) for c in by_item[item]))
            for item in sorted(flats)
        )
        if self._local is not None and self._local.key == key:
            return self._local
        files = []
        offset = 0
        for item in sorted(flats):
            cs = sorted(by_item[item], key=lambda c: (-fmt.DTYPES[c[4]][0], c[1], c[2]))
            if not cs and item not in tree_items:
                continue
            rel = 0
            table = []
            entries = []
            for _item, k, offs, shape, dtype, nbytes, _src in cs:
                table.append([k, list(offs), list(shape), dtype, rel, rel + nbytes])
                code = fmt.DTYPES[dtype][1]
                name = f"{k}@{','.join(map(str, offs))}"
                st_shape = list(shape) if code is not None else [nbytes]
                entries.append(
                    json.dumps(name)
                    + ":"
                    + json.dumps(
                        {
                            "dtype": code or "U8",
                            "shape": st_shape,
                            "data_offsets": [rel, rel + nbytes],
                        },
                        separators=(",", ":"),
                    )
                )
                rel += nbytes
            meta_chunks = json.dumps([c[:4] for c in table], separators=(",", ":"))
            files.append(
                _FilePlan(
                    item,
                    fmt.item_file(item, self.rank),
                    offset,
                    rel,
                    table,
                    item in tree_items,
                    ",".join(entries),
                    meta_chunks,
                )
            )
            offset += -(-rel // _DATA_ALIGN) * _DATA_ALIGN
        plan = _LocalPlan(key, files, offset)
        old = self._local
        self._local = plan
        if old is not None:
            with self._slot_cv:
                for s in old.slots:
                    s.retired = True
                    if not s.busy:
                        self._free_buffer(s.buffer)
        return plan

    def _free_buffer(self, buffer: StagingBuffer) -> None:
        if self._writer is not None:
            self._writer.submit(("free", buffer))
        else:
            buffer.close()

    def _acquire_slot(self, plan: _LocalPlan) -> _Slot:
        with self._slot_cv:
            while True:
                for s in plan.slots:
                    if not s.busy:
                        s.busy = True
                        return s
                if len(plan.slots) < self.staging_slots:
                    slot = self._new_slot(plan)
                    slot.busy = True
                    plan.slots.append(slot)
                    return slot
                self._slot_cv.wait()

    def _release_slot(self, slot: _Slot) -> None:
        with self._slot_cv:
            slot.busy = False
            if slot.retired:
                self._free_buffer(slot.buffer)
            self._slot_cv.notify_all()

    def _new_slot(self, plan: _LocalPlan) -> _Slot:
        pin = torch.cuda.is_available() and torch.cuda.is_initialized()
        buf = StagingBuffer(plan.total, shared=self.async_mode == "process", pin=pin)
        views = {}
        for f in plan.files:
            for k, offs, shape, dtype, rel, end in f.chunks:
                region = buf.tensor[f.offset + rel : f.offset + end]
                views[(f.item, k, tuple(offs))] = region.view(tr.torch_dtype(dtype)).view(shape)
        return _Slot(buf, views)

    def _stage(self, slot: _Slot, chunks: list[tuple]) -> list[Any]:
        devices = set()
        for item, key, offs, _shape, _dtype, nbytes, src in chunks:
            if nbytes == 0:
                continue
            dst = slot.views[(item, key, offs)]
            if src.device.type == "cpu":
                dst.copy_(src)
            else:
                dst.copy_(src, non_blocking=dst.is_pinned())
                devices.add(src.device)
        events = []
        for dev in devices:  # the writer waits for these before reading the buffer
            if dev.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                events.append(ev)
            else:  # pragma: no cover - other accelerators: wait here
                torch.accelerator.synchronize(dev)
        return events

    def _job(
        self, step: int, flats: dict[str, tr.Flat], plan: _LocalPlan, slot: _Slot
    ) -> dict[str, Any]:
        assert self._global is not None
        nonce, seq = self._global.nonce, self._seq
        folder = fmt.step_dir(step, nonce, seq)
        token = f"{nonce}-{seq}"
        files = []
        for f in plan.files:
            tree = json.dumps(flats[f.item].tree, separators=(",", ":")) if f.tree else "null"
            meta = (
                f'{{"format":"{fmt.FORMAT}","item":{json.dumps(f.item)},"rank":{self.rank},'
                f'"step":{step},"tree":{tree},"chunks":{f.meta_chunks_json}}}'
            )
            head = '{"__metadata__":' + json.dumps({fmt.META_KEY: meta}, separators=(",", ":"))
            head += ("," + f.table_json if f.table_json else "") + "}"
            text = head.encode()
            # Pad the header (safetensors allows trailing spaces) so the data starts at a
            # 4 KiB boundary of the file: the writer can then use O_DIRECT straight from the
            # page-aligned staging buffer.
            text += b" " * (-(len(text) + 8) % _DATA_ALIGN)
            header = len(text).to_bytes(8, "little") + text
            files.append(
                {
                    "name": f.name,
                    "item": f.item,
                    "header": header,
                    "buffer": slot.buffer.id,
                    "offset": f.offset,
                    "size": f.size,
                    "chunks": f.chunks,
                    "tree": f.tree,
                }
            )
        marker = {
            "format": fmt.FORMAT,
            "token": token,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": step,
        }
        manifest = None
        if self.rank == 0:
            manifest = fmt.dump_checked(
                {
                    "format": fmt.FORMAT,
                    "token": token,
                    "step": step,
                    "world_size": self.world_size,
                    "time": time.time(),
                    "block_size": self.block_size,
                    "tree_rank": 0,
                    "items": self._global.manifest_items,
                }
            )
        return {
            "id": seq,
            "seq": seq,
            "dir": folder,
            "step": step,
            "rank": self.rank,
            "block_size": self.block_size,
            "files": files,
            "marker": marker,
            "manifest": manifest,
        }

    # ----------------------------------------------------------------------- listing
    def _complete(self) -> list[tuple[int, float, str, dict[str, Any]]]:
        out = []
        for step, _nonce, _seq, name in wr.list_attempts(self.storage):
            manifest = self._complete_cache.get(name)
            if manifest is None:
                manifest = wr.complete_manifest(self.storage, name)
                if manifest is None:
                    continue
                self._complete_cache[name] = manifest
            out.append((step, float(manifest.get("time", 0.0)), name, manifest))
        out.sort(key=lambda x: (x[0], x[1]))
        return out

    def steps(self) -> list[int]:
        """Steps that have a complete checkpoint, ascending."""
        return sorted({c[0] for c in self._complete()})

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _find(self, step: int | None) -> tuple[str, dict[str, Any]]:
        complete = self._complete()
        if not complete:
            raise CheckpointNotFoundError(f"no complete checkpoint under {self.storage!r}")
        if step is None:
            _, _, name, manifest = complete[-1]
            return name, manifest
        matches = [c for c in complete if c[0] == step]
        if not matches:
            raise CheckpointNotFoundError(
                f"no complete checkpoint for step {step} under {self.storage!r}; complete "
                f"steps: {sorted({c[0] for c in complete})}"
            )
        _, _, name, manifest = matches[-1]
        return name, manifest

    # --------------------------------------------------------------------------- load
    def load(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        verify: bool = True,
    ) -> int:
        """Fill ``state`` in place from the checkpoint of ``step`` (default: the latest).

        Items absent from ``state`` are not read. Within an item, tensor entries must match
        the checkpoint (keys, dtypes, global shapes) or a ``StateMismatchError`` lists every
        difference before anything is touched; ``strict=False`` skips missing/unexpected
        entries instead (mismatched shapes still fail). Any sharding of the same global
        tensors loads (other world size, DTensor placements, sharded-protocol chunks).
        ``verify=False`` skips the per-block XXH3-64 checks of tensor data (file sizes and the
        JSON files' checksums are still checked). Returns the step loaded.
        """
        self._check_open()
        self._raise_pending()
        _check_state(state, "load")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"load: step must be an int or None, got {step!r}")
        folder, manifest = self._find(step)
        try:
            return self._load(state, folder, manifest, strict, verify)
        except FileNotFoundError as e:
            self._complete_cache.pop(folder, None)
            raise CorruptCheckpointError(
                f"{folder}: a file of this checkpoint disappeared while loading ({e})"
            ) from e

    def _load(
        self,
        state: dict[str, Any],
        folder: str,
        manifest: dict[str, Any],
        strict: bool,
        verify: bool,
    ) -> int:
        world = manifest["world_size"]
        markers = []
        for r in range(world):
            path = f"{folder}/{fmt.marker_file(r)}"
            m = fmt.load_checked(self.storage.read(path), path)
            if m.get("token") != manifest["token"] or m.get("rank") != r:
                raise CorruptCheckpointError(
                    f"{path}: done-marker belongs to another save ({m.get('token')!r}, rank "
                    f"{m.get('rank')!r}), expected {manifest['token']!r}",
                    path,
                )
            markers.append(m)
        items_m = manifest["items"]
        missing_items = [item for item in state if item not in items_m]
        if missing_items:
            raise StateMismatchError(
                f"load: items {missing_items} are not in the checkpoint at {folder} (it has "
                f"{sorted(items_m)})",
                missing_items,
                [],
                [],
            )
        per_rank_items = [i for i in state if items_m[i]["per_rank"]]
        if per_rank_items and world != self.world_size:
            raise CheckpointError(
                f"load: PerRank items {per_rank_items} were saved by {world} ranks and cannot "
                f"be loaded by {self.world_size}; leave them out of the state to load the rest"
            )
        # Stored chunks by (item, key) and file table.
        stored: dict[tuple[str, str], list[rs.StoredChunk]] = {}
        files: dict[str, rs.FileInfo] = {}
        tree_files: dict[str, tuple[str, int]] = {}
        for r, m in enumerate(markers):
            for name, info in m["files"].items():
                path = f"{folder}/{name}"
                files[path] = rs.FileInfo(
                    path, info["size"], info["block_size"], info["block_xxh3_64"]
                )
                item = info["item"]
                if info["tree"] and (
                    (items_m.get(item, {}).get("per_rank") and r == self.rank)
                    or (not items_m.get(item, {}).get("per_rank") and r == 0)
                ):
                    tree_files[item] = (path, info["data_start"])
                if items_m.get(item, {}).get("per_rank") and r != self.rank:
                    continue
                start0 = info["data_start"]
                for key, offs, shape, dtype, rel, _end in info["chunks"]:
                    stored.setdefault((item, key), []).append(
                        rs.StoredChunk(path, tuple(offs), tuple(shape), dtype, start0 + rel)
                    )
        # Optimizers restored into a fresh optimizer need their lazily created state first.
        for item, value in state.items():
            target = value.value if isinstance(value, tr.PerRank) else value
            if _is_empty_optimizer(target) and any(
                k.startswith("state.") for k, _ in _stored_keys(item, items_m, stored)
            ):
                _init_optimizer_state(target)
        with torch.no_grad():
            flats = {
                item: tr.flatten(
                    item, _as_target(value, items_m[item]["per_rank"]), record_sds=True
                )
                for item, value in state.items()
            }
            missing, unexpected, mismatched = [], [], []
            for item, flat in flats.items():
                have = dict(_stored_keys(item, items_m, stored))
                for key, leaf in flat.leaves.items():
                    name = tr.display(item, key)
                    if key not in have:
                        missing.append(name)
                        continue
                    dtype, shape = have[key]
                    if dtype != leaf.dtype or tuple(shape) != leaf.shape:
                        mismatched.append(
                            (name, f"{leaf.dtype}{list(leaf.shape)}", f"{dtype}{list(shape)}")
                        )
                for key in have:
                    if key not in flat.leaves:
                        unexpected.append(tr.display(item, key))
            if mismatched or (strict and (missing or unexpected)):
                raise StateMismatchError.listing(
                    f"the checkpoint at {folder}", missing, unexpected, mismatched
                )
            # Check sizes of every file we will read before touching the target.
            plan = rs.ReadPlan()
            for item, flat in flats.items():
                for key, leaf in flat.leaves.items():
                    if (item, key) not in stored:
                        continue
                    rs.plan_leaf(plan, item, leaf, stored[(item, key)], rs.local_chunks(leaf))
            needed = set(plan.requests) | {p for p, _ in tree_files.values()}
            for path in sorted(needed):
                try:
                    size = self.storage.size(path)
                except FileNotFoundError as e:
                    raise CorruptCheckpointError(
                        f"{path}: file of a complete checkpoint is missing", path
                    ) from e
                if size != files[path].size:
                    raise CorruptCheckpointError(
                        f"{path}: file is {size} bytes, its done-marker says "
                        f"{files[path].size}; it is truncated or was replaced",
                        path,
                    )
            trees = {}
            for item in flats:
                if item not in tree_files:
                    raise CorruptCheckpointError(
                        f"{folder}: no file holds the non-tensor state of item {item!r}"
                    )
                path, data_start = tree_files[item]
                trees[item] = self._read_tree(path, data_start, files[path])
            for item, flat in flats.items():
                tree_keys = tr.tree_tensor_keys(trees[item])
                extra = [k for k in tree_keys if k not in flat.leaves]
                if extra and strict:  # pragma: no cover - caught above through the markers
                    raise StateMismatchError.listing(f"the checkpoint at {folder}", [], extra, [])
            if not verify:
                files = {p: rs.FileInfo(p, f.size, None, None) for p, f in files.items()}
            rs.execute(self.storage, plan, files, threads=self.io_threads)
            for item, flat in flats.items():
                value = state[item]
                if isinstance(value, tr.PerRank):
                    value.value = tr.fill(value.value, trees[item], flat)
                else:
                    state[item] = tr.fill(value, trees[item], flat)
        return int(manifest["step"])

    def _read_tree(self, path: str, data_start: int, info: rs.FileInfo) -> Any:
        buf = bytearray(data_start)
        fmt.read_verified(
            self.storage,
            path,
            [fmt.ReadRequest(0, data_start, memoryview(buf))],
            size=info.size,
            block_size=info.block_size,
            crcs=info.crcs,
        )
        try:
            head = json.loads(bytes(buf[8:]))
            meta = json.loads(head["__metadata__"][fmt.META_KEY])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{path}: unreadable header ({e})", path) from e
        return meta["tree"]


# ------------------------------------------------------------------------------ helpers


def _check_state(state: Any, what: str) -> None:
    if not isinstance(state, dict) or not state:
        raise TypeError(
            f"{what}: state must be a non-empty dict of top-level items (e.g. "
            f"{{'model': model, 'optim': optimizer}}), got {type(state).__name__}"
        )
    for k in state:
        if not isinstance(k, str) or not k:
            raise TypeError(f"{what}: state keys must be non-empty str item names, got {k!r}")


def _writes_replica(dt: Any, name: str) -> bool:
    """Whether this rank writes its shard of ``dt``: on every mesh dim where the tensor is
    replicated, one coordinate (chosen by a hash of the name, to spread the writes) does."""
    from torch.distributed.tensor import Replicate

    rs.check_placements(dt, name)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    h = zlib.crc32(name.encode())
    return all(
        coord[d] == h % mesh.size(d)
        for d, p in enumerate(dt.placements)
        if isinstance(p, Replicate)
    )


def _stored_keys(
    item: str, items_m: dict[str, Any], stored: dict[tuple[str, str], list[rs.StoredChunk]]
) -> list[tuple[str, tuple[str, tuple[int, ...]]]]:
    if items_m[item]["per_rank"]:
        out = {}
        for (it, key), chunks in stored.items():
            if it == item:
                out[key] = (chunks[0].dtype, chunks[0].shape)
        return list(out.items())
    return [(k, (e[1], tuple(e[2]))) for k, e in items_m[item]["entries"].items()]


def _as_target(value: Any, per_rank: bool) -> Any:
    if per_rank and not isinstance(value, tr.PerRank):
        return tr.PerRank(value)
    if not per_rank and isinstance(value, tr.PerRank):
        return value.value
    return value


def _is_empty_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) and not obj.state


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's lazy state (one step with zero gradients and lr 0), so a
    checkpoint's state has tensors to load into. Parameters are unchanged."""
    grads = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                grads.append((p, p.grad))
                p.grad = torch.zeros_like(p)
    lrs = []
    for group in opt.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    opt.step()
    for group, lr in zip(opt.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    for p, g in grads:
        p.grad = g
