"""``CheckpointManager``: async distributed checkpoints with one metadata exchange.

Save, per rank (the jobs live in their own modules):

1. flatten the state (``state_dict()`` of stateful objects) into tensor entries and a JSON
   skeleton of everything else (``_tree``);
2. the first time a global layout is seen, ONE ``allgather`` decides which rank writes each
   replicated tensor (``_exchange``); never again for that layout;
3. copy this rank's chunks into a reused staging buffer and return a ``SaveHandle``: the
   caller may now mutate its tensors (``_staging``);
4. a background writer (a thread, or a torch-free process sharing the buffer) writes one
   safetensors file per item, then this rank's done-marker, then (rank 0) the manifest, and
   applies retention (``_writer``, ``_retention``).

Load finds the newest complete checkpoint (``_retention``), fills the state from it
(``_load``), and with ``fallback=True`` moves on to older ones while one turns out damaged.
A lock per root and rank (``_lock``) keeps a second live manager out.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import secrets
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from . import _exchange as ex
from . import _format as fmt
from . import _retention as ret
from . import _tree as tr
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptCheckpointError,
)
from ._handle import SaveHandle
from ._load import load_first_intact, load_folder
from ._lock import RootLock
from ._staging import Stager, StagingBuffer
from ._stats import LoadStats, total_time
from ._writer import BackgroundWriter, check_process_safe, execute_job
from .policy import ASYNC_MODES, CheckpointPolicy
from .storage import FileSystemStorage, PrefixedStorage, Storage

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["ASYNC_MODES", "CheckpointManager", "SaveHandle"]

_RETENTION_WAIT_S = 120.0
_STORAGE_MEMBERS = tuple(
    sorted({n for n in vars(Storage) if not n.startswith("_")} | set(Storage.__annotations__))
)


_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # pending saves finish before the interpreter exits
    for m in list(_live):
        with contextlib.suppress(Exception):
            m.close()


def _shutdown(writer: BackgroundWriter | None, lock: RootLock | None) -> None:
    """What a manager dropped without ``close()`` still owes: its writer and its lock."""
    with contextlib.suppress(Exception):
        if writer is not None:
            writer.close()
    if lock is not None:
        lock.release()


class CheckpointManager:
    """Async distributed checkpoints under ``root``.

    Args:
        root: folder of the checkpoints (a ``FileSystemStorage`` is made for it), or, with
            ``storage=``, a sub-folder inside that storage (``None``/``""``: its root).
        storage: a ``Storage`` backend (``FileSystemStorage``, ``FsspecStorage``, your own).
        process_group: the group whose ranks save together; default: the default group when
            ``torch.distributed`` is initialised, else a single process.
        policy: how to write, keep and read (``CheckpointPolicy``); its fields may also be
            given as keywords (``keep_last=3``), which override ``policy``'s.

    Each rank holds a lock on the root while open (``read_only=True`` takes none): a second
    manager on the same root fails with a ``CheckpointLockedError`` naming the holder.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None,
        *,
        storage: Storage | None = None,
        process_group: ProcessGroup | None = None,
        policy: CheckpointPolicy | None = None,
        **options: Any,
    ) -> None:
        if policy is not None and not isinstance(policy, CheckpointPolicy):
            raise TypeError(
                f"CheckpointManager: policy must be a CheckpointPolicy, got {type(policy).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(CheckpointPolicy)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(
                f"CheckpointManager: unknown option(s) {unknown}; the options are the fields of "
                f"CheckpointPolicy: {sorted(fields)}"
            )
        policy = dataclasses.replace(policy or CheckpointPolicy(), **options)
        storage = _resolve_storage(root, storage)
        if policy.async_mode == "process" and not policy.read_only:
            check_process_safe(storage)
        self.storage = storage
        self.policy = policy
        self._pg = _resolve_group(process_group)
        self.rank = self._pg.rank() if self._pg is not None else 0
        self.world_size = self._pg.size() if self._pg is not None else 1
        self._lock: RootLock | None = None
        if not policy.read_only:
            self._lock = RootLock(storage, self.rank, self.world_size)
            self._lock.acquire()
        self._mutex = threading.RLock()
        self._global: ex.GlobalPlan | None = None
        self._layout = ex.LayoutCache()
        self._nonces: list[str] = []
        self._seq = 0
        self._handles: list[SaveHandle] = []
        self._lineage = secrets.token_hex(6)  # a new run's; load() may continue another's
        self._attempts_cache: dict[str, ret.Attempt] = {}
        self._reported: set[str] = set()  # damaged folders warned about (own lock: the
        self._reported_lock = threading.Lock()  # writer thread reports while save() waits)
        self._writer: BackgroundWriter | None = None
        if policy.async_mode != "off" and not policy.read_only:
            fds = [self._lock.fd] if self._lock is not None and self._lock.fd is not None else []
            ref = weakref.ref(self)  # the writer must not keep the manager alive

            def on_damaged(damaged: list[tuple[str, str]]) -> None:
                manager = ref()
                if manager is not None:
                    manager._report_damaged(damaged)

            self._writer = BackgroundWriter(
                policy.async_mode, storage, on_damaged=on_damaged, inherit_fds=fds
            )
        self._stager = Stager(
            self.rank,
            shared=policy.async_mode == "process",
            slots=policy.staging_slots,
            free=self._free_buffer,
        )
        self._closed = False
        self.collectives = 0  # metadata exchanges run so far (for tests and logs)
        self._finalizer = weakref.finalize(self, _shutdown, self._writer, self._lock)
        _live.add(self)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.storage!r}, rank={self.rank}/{self.world_size}, "
            f"async_mode={self.policy.async_mode!r}, keep_last={self.policy.keep_last})"
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(abandon_retention=exc_type is not None)

    # ------------------------------------------------------------------------- errors
    def _raise_pending(self) -> None:
        with self._mutex:
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

    def _report_damaged(self, damaged: list[tuple[str, str]]) -> None:
        """Warn once per folder about damaged checkpoints (they are never deleted)."""
        with self._reported_lock:
            new = [(n, r) for n, r in damaged if n not in self._reported]
            self._reported.update(n for n, _ in new)
        for name, reason in new:
            warnings.warn(
                f"torch_checkpointing: checkpoint {self.storage!r}/{name} is damaged and is "
                f"not listed as complete; it was left in place for inspection: {reason}",
                CheckpointWarning,
                stacklevel=3,
            )

    # --------------------------------------------------------------------------- save
    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        """Stage ``state`` for ``step`` and queue its write; returns once the state is copied.

        Raises the error of an earlier save that failed since the last call, before doing
        anything. Every rank of the group must call ``save`` with the same steps in the same
        order (it is collective only the first time a layout is seen).
        """
        self._check_open()
        if self.policy.read_only:
            raise CheckpointError("save: this CheckpointManager was opened with read_only=True")
        self._raise_pending()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"save: step must be an int >= 0, got {step!r}")
        if step >= 10**12:
            raise ValueError(f"save: step must be < 10**12, got {step}")
        _check_state(state, "save")
        if self._lock is not None:
            self._lock.announce()
        with self._mutex, torch.no_grad():
            flats = {item: tr.flatten(item, value) for item, value in state.items()}
            digest, summary = ex.digest(flats, self.world_size, self.policy.block_size)
            if self._global is None or self._global.digest != digest:
                self._layout.clear()
                own = ex.own_chunks(flats, self._layout)
                self._global = ex.exchange(self._pg, self.rank, flats, digest, summary, own)
                self._nonces.append(self._global.nonce)
                if self._pg is not None:
                    self.collectives += 1
            else:
                own = ex.own_chunks(flats, self._layout)
            chunks = own + ex.replicated_chunks(flats, self._global, self.rank)
            plan = self._stager.plan(flats, chunks)
            slot = self._stager.acquire(plan)
            try:
                self._raise_pending()  # a save that failed while we waited for the slot
                events = self._stager.stage(slot, chunks)
                job = self._job(step, flats, plan, slot)
            except BaseException:
                self._stager.release(slot)
                raise
            handle = SaveHandle(step, job["dir"])
            self._seq += 1

        def done(error: BaseException | None, slot: Any = slot) -> None:
            self._stager.release(slot)
            handle._finish(error)

        keep = self.policy.keep_last is not None and self.rank == 0
        if self._writer is None:
            error = None
            try:
                execute_job(self.storage, job, lambda _i: slot.buffer.view)
            except BaseException as e:
                error = e
            done(error)
            if error is not None:
                handle._reported = True
                raise error
            if keep:
                try:
                    result = ret.run_retention(self.storage, self._retention_spec(job))
                except Exception as e:
                    warnings.warn(
                        f"torch_checkpointing: keep_last retention failed (nothing more was "
                        f"deleted): {e}",
                        CheckpointWarning,
                        stacklevel=2,
                    )
                else:
                    self._report_damaged(result.damaged)
            return handle
        with self._mutex:
            self._handles.append(handle)
        self._writer.submit(("job", job, slot.buffer, events, done))
        if keep:
            self._writer.submit(("retain", self._retention_spec(job)))
        return handle

    def _job(self, step: int, flats: dict[str, tr.Flat], plan: Any, slot: Any) -> dict[str, Any]:
        assert self._global is not None
        nonce, seq = self._global.nonce, self._seq
        token = f"{nonce}-{seq}"
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
                    "block_size": self.policy.block_size,
                    "tree_rank": 0,
                    "lineage": self._lineage,
                    "items": self._global.manifest_items,
                }
            )
        return self._stager.job(
            plan,
            slot,
            flats,
            folder=fmt.step_dir(step, nonce, seq),
            marker=marker,
            manifest=manifest,
            seq=seq,
            block_size=self.policy.block_size,
        )

    def _retention_spec(self, job: dict[str, Any]) -> dict[str, Any]:
        return {
            "dir": job["dir"],
            "keep_last": self.policy.keep_last,
            "lineage": self._lineage,
            "own_nonces": list(self._nonces),
            "seq": job["seq"],
            "wait_s": _RETENTION_WAIT_S,
        }

    def _free_buffer(self, buffer: StagingBuffer) -> None:
        if self._writer is not None:
            self._writer.submit(("free", buffer))
        else:
            buffer.close()

    def wait(self) -> None:
        """Wait until every queued save of this rank is written; raise the first failure not
        yet reported."""
        if self._writer is not None:
            self._writer.wait_idle()
        self._raise_pending()

    def close(self, *, abandon_retention: bool = False) -> None:
        """Wait for queued saves, stop the writer, free the staging buffers, drop the lock.

        ``keep_last`` retention of the newest save waits (up to 120 s) for every rank to
        complete it before deleting older checkpoints. ``abandon_retention=True`` (what the
        context manager passes when an exception leaves it) skips that wait, for a job ending
        on a failed peer: this rank's writes still finish, nothing more is deleted, and the
        next save's retention catches up."""
        if self._closed:
            return
        try:
            if self._writer is not None:
                self._writer.close(abandon_retention=abandon_retention)
        finally:
            self._closed = True
            _live.discard(self)
            self._stager.close()
            self._finalizer.detach()
            if self._lock is not None:
                self._lock.release()
        self._raise_pending()

    # ----------------------------------------------------------------------- listing
    def _attempts(self) -> list[ret.Attempt]:
        attempts = ret.list_attempts(self.storage, self._attempts_cache)
        self._report_damaged([(a.name, a.reason) for a in attempts if a.status == ret.DAMAGED])
        return attempts

    def steps(self) -> list[int]:
        """Steps that have a complete checkpoint, ascending. Damaged checkpoints (a manifest
        that fails its checksum, ...) are not listed; each is reported once as a
        ``CheckpointWarning`` naming the folder and what is wrong."""
        return sorted({a.step for a in self._attempts() if a.status == ret.COMPLETE})

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or ``None`` (damaged ones are reported,
        as in ``steps()``)."""
        steps = self.steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------------------- load
    def load(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        verify: bool = True,
        fallback: bool = False,
        stats: LoadStats | None = None,
    ) -> int:
        """Fill ``state`` in place from the checkpoint of ``step`` (default: the newest one).

        Items absent from ``state`` are not read. Within an item, tensor entries must match
        the checkpoint (keys, dtypes, global shapes) or a ``StateMismatchError`` lists every
        difference before anything is touched; ``strict=False`` skips missing/unexpected
        entries instead (mismatched shapes still fail). Any sharding of the same global
        tensors loads (other world size, DTensor placements, sharded-protocol chunks).
        ``verify=False`` skips the per-block XXH3-64 checks of tensor data (file sizes and the
        JSON files' checksums are still checked).

        A damaged checkpoint (missing, truncated or corrupt file) raises a
        ``CorruptCheckpointError`` naming the file. With ``fallback=True`` the newest intact
        checkpoint at or below ``step`` is loaded instead, with a ``CheckpointWarning`` naming
        each one skipped and why; nothing is deleted. ``fallback=True`` is collective: every
        rank of the group calls it, and all ranks load the same step.

        Tensors are read in place and verified as they arrive (damage: see above); ``stats``
        (a ``LoadStats``) gets where the time went.

        Returns the step loaded. Loading the newest checkpoint of a run continues that run's
        lineage (``keep_last`` retention goes on deleting its old checkpoints); loading any
        other starts a new lineage, which leaves every existing checkpoint alone.
        """
        with total_time(stats):
            return self._load(state, step, strict, verify, fallback, stats)

    def _load(self, state, step, strict, verify, fallback, stats) -> int:
        self._check_open()
        self._raise_pending()
        _check_state(state, "load")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"load: step must be an int or None, got {step!r}")
        if not isinstance(fallback, bool):
            raise TypeError(f"load: fallback must be a bool, got {fallback!r}")
        attempts = self._attempts()
        readable = [a for a in attempts if a.status != ret.INCOMPLETE]
        if step is None:
            candidates = readable
        elif fallback:
            candidates = [a for a in readable if a.step <= step]
        else:
            candidates = [a for a in readable if a.step == step]
        candidates = candidates[::-1]  # newest first
        skipped: list[tuple[ret.Attempt, str]] = []
        if not candidates and not fallback:
            self._not_found(step, attempts)
        if fallback:
            loaded, skipped = load_first_intact(
                self._pg, candidates, lambda a: self._load_one(state, a, strict, verify, stats)
            )
            if loaded is None:
                detail = "; ".join(f"{a.name}: {r}" for a, r in skipped)
                where = "" if step is None else f" at or below step {step}"
                raise CheckpointNotFoundError(
                    f"no intact checkpoint{where} under {self.storage!r}"
                    + (f"; every one is damaged: {detail}" if skipped else "")
                )
            if skipped:
                with self._reported_lock:
                    self._reported.update(a.name for a, _ in skipped)
                detail = "; ".join(f"{a.name} (step {a.step}): {r}" for a, r in skipped)
                warnings.warn(
                    f"torch_checkpointing: loaded step {loaded.step} ({loaded.name}) instead of "
                    f"step {skipped[0][0].step}, because newer checkpoints are damaged; they were "
                    f"left in place: {detail}",
                    CheckpointWarning,
                    stacklevel=3,  # the caller of load()
                )
        else:
            loaded = candidates[0]
            try:
                self._load_one(state, loaded, strict, verify, stats)
            except CorruptCheckpointError as e:
                older = [
                    a.step for a in readable[::-1] if a.status == ret.COMPLETE and a is not loaded
                ]
                hint = (
                    f"; load(..., fallback=True) loads the newest intact checkpoint instead "
                    f"(candidates: steps {older[:3]}), and leaves this one in place"
                    if older
                    else ""
                )
                raise CorruptCheckpointError(f"{e}{hint}", e.path) from e
        self._continue_lineage(loaded, attempts, forked=bool(fallback and skipped))
        return loaded.step

    def _not_found(self, step: int | None, attempts: list[ret.Attempt]) -> None:
        complete = sorted({a.step for a in attempts if a.status == ret.COMPLETE})
        if step is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {self.storage!r}")
        raise CheckpointNotFoundError(
            f"no complete checkpoint for step {step} under {self.storage!r}; complete "
            f"steps: {complete}"
        )

    def _load_one(self, state: dict[str, Any], a: ret.Attempt, strict, verify, stats) -> None:
        if a.status == ret.DAMAGED:
            raise CorruptCheckpointError(
                f"{a.name} (step {a.step}) is damaged: {a.reason}", f"{a.name}/{fmt.MANIFEST}"
            )
        assert a.manifest is not None
        try:
            load_folder(
                self.storage,
                state,
                a.name,
                a.manifest,
                rank=self.rank,
                world_size=self.world_size,
                strict=strict,
                verify=verify,
                io_threads=self.policy.io_threads,
                layout=self._layout,
                stats=stats,
            )
        except FileNotFoundError as e:
            self._attempts_cache.pop(a.name, None)
            raise CorruptCheckpointError(
                f"{a.name}: a file of this checkpoint is missing ({e})", a.name
            ) from e

    def _continue_lineage(
        self, loaded: ret.Attempt, attempts: list[ret.Attempt], *, forked: bool
    ) -> None:
        """Continue ``loaded``'s lineage when it is that lineage's newest checkpoint and
        nothing newer is damaged (skipped by a fallback, or left out of ``latest_step()``);
        else the run goes on as a new lineage, so retention never deletes a checkpoint it did
        not write, nor the intact ones older than a damaged one."""
        lineage = loaded.lineage
        same = [a for a in attempts if a.status == ret.COMPLETE and a.lineage == lineage]
        damaged_after = any(a.status == ret.DAMAGED and a.step > loaded.step for a in attempts)
        newest = same and same[-1].name == loaded.name
        if not forked and not damaged_after and lineage is not None and newest:
            self._lineage = lineage
        else:
            self._lineage = secrets.token_hex(6)


# ------------------------------------------------------------------------------ helpers


def _resolve_storage(root: str | os.PathLike[str] | None, storage: Storage | None) -> Storage:
    if storage is None:
        if root is None:
            raise ValueError("CheckpointManager: pass root=... (a folder) or storage=...")
        return FileSystemStorage(root)
    if not isinstance(storage, Storage):
        missing = [m for m in _STORAGE_MEMBERS if not hasattr(storage, m)]
        raise TypeError(
            f"CheckpointManager: storage {storage!r} does not implement the Storage protocol: "
            f"it lacks {missing} (a Storage has {list(_STORAGE_MEMBERS)})"
        )
    if root not in (None, ""):
        return PrefixedStorage(storage, os.fspath(root))
    return storage


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


def _check_state(state: Any, what: str) -> None:
    if not isinstance(state, dict) or not state:
        raise TypeError(
            f"{what}: state must be a non-empty dict of top-level items (e.g. "
            f"{{'model': model, 'optim': optimizer}}), got {type(state).__name__}"
        )
    for k in state:
        if not isinstance(k, str) or not k:
            raise TypeError(f"{what}: state keys must be non-empty str item names, got {k!r}")
