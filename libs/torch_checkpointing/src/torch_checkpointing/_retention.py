"""Which checkpoint folders are complete, damaged or unfinished, and what retention deletes.

Imports no torch: the background writer process runs retention.

Every save attempt has its own folder (``_format.step_dir``). An attempt is

* **complete** when its ``manifest.json`` reads back with a valid checksum, describes that
  very folder, and a done-marker of every rank it lists is present;
* **damaged** when its manifest is present but unreadable, out of range (``_validate``) or
  describes another folder: such a folder is reported, never listed as a checkpoint, and never
  deleted (whatever it holds: garbage, a FIFO, a symlink, another tool's files);
* **incomplete** otherwise (a save still being written, failed, or cut short by a crash).

Each manifest names its *lineage*: a run that starts without loading begins a new lineage, a
run that loads the newest checkpoint of a lineage continues it. Retention only ever deletes
complete checkpoints of its own lineage, failed attempts of its own saves, and attempts
without a manifest that can no longer finish (the root's lock proves their writer is gone).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _format as fmt
from ._errors import CorruptCheckpointError
from ._validate import check_manifest

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from .storage import Storage

COMPLETE, DAMAGED, INCOMPLETE = "complete", "damaged", "incomplete"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One save attempt's folder and what it holds."""

    name: str
    step: int
    nonce: str
    seq: int
    status: str  # COMPLETE | DAMAGED | INCOMPLETE
    manifest: dict[str, Any] | None = None  # COMPLETE only
    reason: str = ""  # DAMAGED / INCOMPLETE: why
    has_manifest: bool = False
    only_ours: bool = True  # every name inside is one this library writes
    lasting: bool = True  # the status cannot change (not an I/O error that may pass)

    @property
    def lineage(self) -> str | None:
        return None if self.manifest is None else self.manifest.get("lineage")

    @property
    def time(self) -> float:
        return 0.0 if self.manifest is None else float(self.manifest.get("time", 0.0))


_OURS_RE = re.compile(r"^(?:.+-\d{5}\.safetensors|done-\d{5}\.json|manifest\.json|\.tmp-.+)$")


def read_manifest(storage: Storage, folder: str) -> dict[str, Any]:
    """The manifest of ``folder``, range-checked; damage is a ``CorruptCheckpointError``."""
    path = f"{folder}/{fmt.MANIFEST}"
    manifest = fmt.load_checked(fmt.read_small(storage, path, fmt.MANIFEST_MAX_BYTES), path)
    check_manifest(manifest, path)
    return manifest


def classify(storage: Storage, name: str, step: int, nonce: str, seq: int) -> Attempt:
    """The status of one attempt folder (one ``list`` and at most one small read); never
    raises on what the folder holds."""
    try:
        names = set(storage.list(name))
    except OSError as e:
        return Attempt(name, step, nonce, seq, DAMAGED, reason=f"cannot list: {e}", lasting=False)
    ours = all(isinstance(n, str) and _OURS_RE.match(n) for n in names)
    if fmt.MANIFEST not in names:
        return Attempt(
            name, step, nonce, seq, INCOMPLETE, reason="no manifest.json yet", only_ours=ours
        )
    path = f"{name}/{fmt.MANIFEST}"

    def damaged(reason: str, lasting: bool = True) -> Attempt:
        return Attempt(
            name, step, nonce, seq, DAMAGED, reason=reason, has_manifest=True, lasting=lasting
        )

    try:
        manifest = read_manifest(storage, name)
    except CorruptCheckpointError as e:
        return damaged(str(e))
    except FileNotFoundError:  # deleted while we listed
        return Attempt(name, step, nonce, seq, INCOMPLETE, reason="deleted while listing")
    except OSError as e:  # a backend's I/O error: may pass, so not remembered
        return damaged(f"{path}: unreadable ({e})", lasting=False)
    world = manifest["world_size"]
    if manifest["step"] != step or manifest["token"] != f"{nonce}-{seq}":
        return damaged(
            f"{path}: describes step {manifest.get('step')!r}, save {manifest.get('token')!r}, "
            f"not this folder (step {step}, save {nonce}-{seq}); it was copied or replaced"
        )
    missing: list[int] = []
    for r in range(world):  # stops at the 8th missing: a forged world size costs nothing
        if fmt.marker_file(r) not in names:
            missing.append(r)
            if len(missing) == 8:
                break
    if missing:
        return Attempt(
            name,
            step,
            nonce,
            seq,
            INCOMPLETE,
            reason=f"done-markers of ranks {missing[:8]} missing",
            has_manifest=True,
        )
    return Attempt(name, step, nonce, seq, COMPLETE, manifest=manifest, has_manifest=True)


def list_attempts(storage: Storage, cache: dict[str, Attempt] | None = None) -> list[Attempt]:
    """Every attempt folder under the root, oldest step first (then by write time, then by
    queue order). ``cache`` keeps complete and damaged folders' results, which never change."""
    found = []
    for name in storage.list(""):
        parsed = fmt.parse_step_dir(name)
        if parsed is None:
            continue
        a = cache.get(name) if cache is not None else None
        if a is None:
            try:
                a = classify(storage, name, *parsed)
            except Exception as e:  # a backend's surprise: one folder never hides the rest
                reason = f"cannot classify: {type(e).__name__}: {e}"
                a = Attempt(name, *parsed, DAMAGED, reason=reason, has_manifest=True, lasting=False)
            if cache is not None and a.status != INCOMPLETE and a.lasting:
                cache[name] = a
        found.append(a)
    if cache is not None:
        for gone in set(cache) - {a.name for a in found}:
            del cache[gone]
    return sorted(found, key=lambda a: (a.step, a.time, a.nonce, a.seq))


def delete_checkpoint(storage: Storage, folder: str) -> None:
    """Delete ``folder``, manifest first, so it stops counting as complete before anything else
    disappears."""
    with contextlib.suppress(FileNotFoundError):
        storage.delete(f"{folder}/{fmt.MANIFEST}")
    storage.delete(folder)


def wait_complete(
    storage: Storage,
    folder: str,
    timeout: float,
    cancelled: Callable[[], bool] = lambda: False,
) -> bool:
    parsed = fmt.parse_step_dir(folder)
    assert parsed is not None, folder
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        if classify(storage, folder, *parsed).status == COMPLETE:
            return True
        if time.monotonic() >= deadline or cancelled():
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


@dataclass(slots=True)
class RetentionResult:
    deleted: list[str]
    damaged: list[tuple[str, str]]  # (folder, reason): reported, left in place


def apply_retention(
    storage: Storage, keep_last: int, lineage: str, own_nonces: list[str], seq: int
) -> RetentionResult:
    """Delete what ``keep_last`` no longer keeps of ``lineage``.

    Kept: the ``keep_last`` newest complete checkpoints of the lineage (by step, then by write
    time), every checkpoint of other lineages, every damaged folder. Deleted: older complete
    checkpoints of the lineage and older duplicates of a kept step; attempts of this manager
    older in queue order than ``seq`` that never completed (failed saves); attempts without a
    manifest at or below the lineage's newest step (leftovers of crashed writers) holding only
    names this library writes. Anything else (damaged, foreign, a user's files) stays.
    """
    attempts = list_attempts(storage)
    damaged = [(a.name, a.reason) for a in attempts if a.status == DAMAGED]
    mine = [a for a in attempts if a.status == COMPLETE and a.lineage == lineage]
    if not mine:
        return RetentionResult([], damaged)
    newest_of_step: dict[int, Attempt] = {}
    for a in mine:  # sorted: the last attempt of a step is its newest
        newest_of_step[a.step] = a
    keep = {newest_of_step[s].name for s in sorted(newest_of_step)[-keep_last:]}
    newest_step = mine[-1].step
    doomed = [a.name for a in mine if a.name not in keep]
    for a in attempts:
        if a.status != INCOMPLETE:
            continue
        if a.nonce in own_nonces:
            if a.seq < seq:
                doomed.append(a.name)
        elif not a.has_manifest and a.only_ours and a.step <= newest_step:
            doomed.append(a.name)
    for name in doomed:
        delete_checkpoint(storage, name)
    return RetentionResult(doomed, damaged)


def run_retention(
    storage: Storage, spec: dict[str, Any], cancelled: Callable[[], bool] = lambda: False
) -> RetentionResult:
    """Wait (bounded, until ``cancelled()``) for the checkpoint just saved to be complete, then
    apply retention; nothing is deleted when the wait ends first."""
    if not wait_complete(storage, spec["dir"], spec["wait_s"], cancelled):
        return RetentionResult([], [])
    return apply_retention(
        storage, spec["keep_last"], spec["lineage"], spec["own_nonces"], spec["seq"]
    )
