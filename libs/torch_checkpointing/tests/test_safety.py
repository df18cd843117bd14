"""No checkpoint is lost by mistake: one live manager per root, retention that deletes only its
own run's checkpoints and never a damaged one, damage reported and loads that fall back, and
the faults of a real disk (full, read-only). Every case checks that no checkpoint was lost."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from torch_checkpointing import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointPolicy,
    CheckpointWarning,
    CheckpointWriteError,
    CorruptCheckpointError,
    FileSystemStorage,
    FsspecStorage,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpointing_cases import flip_byte, tree_bytes
from _faulty_storage import FaultyStorage


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"m": {"w": torch.randn(300, generator=g), "b": torch.arange(5) * step}, "meta": {}}


def load_into(mgr: CheckpointManager, step: int | None = None, **kw) -> tuple[int, dict]:
    """Load into an empty state; returns (step loaded, the state) after checking its values."""
    got = {"m": {"w": torch.zeros(300), "b": torch.zeros(5, dtype=torch.int64)}, "meta": {}}
    loaded = mgr.load(got, step, **kw)
    want = state_of(loaded)
    assert torch.equal(got["m"]["w"], want["m"]["w"]) and torch.equal(got["m"]["b"], want["m"]["b"])
    return loaded, got


def save_steps(root, steps, **kw) -> None:
    with CheckpointManager(root, async_mode="off", **kw) as mgr:
        for s in steps:
            mgr.save(s, {**state_of(s), "meta": {"step": s}})


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def dir_of(root: Path, step: int) -> Path:
    (d,) = [p for p in root.iterdir() if p.name.startswith(f"step-{step:012d}.")]
    return d


def messages(caught) -> str:
    return "\n".join(str(w.message) for w in caught if issubclass(w.category, CheckpointWarning))


class HeldStorage(FileSystemStorage):
    """Data-file writes wait until ``gate`` is set: a save held mid-write."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.gate = threading.Event()

    def write(self, path, chunks):
        if path.endswith(".safetensors"):
            assert self.gate.wait(30)
        super().write(path, chunks)


# --------------------------------------------------------------------------------- lock


def test_second_live_manager_fails_naming_the_holder_and_touches_nothing(tmp_path):
    storage = HeldStorage(tmp_path)
    first = CheckpointManager(None, storage=storage, async_mode="thread", keep_last=1)
    storage.gate.set()
    first.save(1, state_of(1)).wait()
    storage.gate.clear()
    pending = first.save(2, state_of(2))  # held mid-write
    before = tree_bytes(tmp_path)
    with pytest.raises(CheckpointLockedError, match=r"in use by another live manager") as info:
        CheckpointManager(tmp_path, keep_last=1)
    text = str(info.value)
    assert f"pid {os.getpid()} on host" in text and "started 20" in text and "rank 0 of 1" in text
    assert info.value.holder["pid"] == os.getpid()
    assert tree_bytes(tmp_path) == before  # the failed manager wrote and deleted nothing
    storage.gate.set()
    pending.wait()
    first.close()
    assert load_into(CheckpointManager(tmp_path, read_only=True))[0] == 2
    with CheckpointManager(tmp_path, keep_last=1) as second:  # free again once closed
        second.save(3, state_of(3)).wait()
    # Opening a manager writes nothing; one that has not saved yet is named all the same.
    stamps = {p: p.stat().st_mtime_ns for p in [tmp_path, *tmp_path.rglob("*")]}
    with (
        CheckpointManager(tmp_path, async_mode="off"),
        pytest.raises(CheckpointLockedError, match=rf"pid {os.getpid()} on host"),
    ):
        CheckpointManager(tmp_path)
    assert {p: p.stat().st_mtime_ns for p in [tmp_path, *tmp_path.rglob("*")]} == stamps


def test_lock_on_a_storage_without_file_locks_and_a_dropped_manager(tmp_path):
    storage = FsspecStorage(f"memory://tcp-{uuid.uuid4().hex}")
    first = CheckpointManager("run", storage=storage, async_mode="thread")
    with pytest.raises(CheckpointLockedError, match=rf"pid {os.getpid()}"):
        CheckpointManager("run", storage=storage, async_mode="off")
    first.save(1, state_of(1)).wait()
    reader = CheckpointManager("run", storage=storage, read_only=True)  # readers take no lock
    assert load_into(reader)[0] == 1
    with pytest.raises(CheckpointError, match="read_only=True"):
        reader.save(2, state_of(2))
    del first  # dropped without close(): its lock goes with it
    gc.collect()
    with CheckpointManager("run", storage=storage, async_mode="off") as again:
        again.save(2, state_of(2))
    assert storage.list("run") == sorted(storage.list("run")) and ".lock-00000.json" not in (
        storage.list("run")
    )


def test_forked_child_does_not_keep_the_root_locked(tmp_path):
    mgr = CheckpointManager(tmp_path, async_mode="off")
    r, w = os.pipe()
    pid = os.fork()  # a data-loader worker, say
    if pid == 0:
        os.read(r, 1)
        os._exit(0)
    try:
        mgr.close()
        CheckpointManager(tmp_path, async_mode="off").close()  # the child's copy holds nothing
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)


HOLDER = textwrap.dedent(
    """
    import sys, time, torch
    from torch_checkpointing import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], async_mode="process")
    mgr.save(1, {"m": {"w": torch.ones(3)}}).wait()  # starts the writer process
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(CheckpointLockedError, match=rf"pid {proc.pid} on host"):
            CheckpointManager(tmp_path, async_mode="off")
        # Kill the trainer alone: its orphaned writer process exits by itself, and the lock
        # is free once both are gone.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        with pytest.warns(CheckpointWarning, match=rf"took over the lock .* pid {proc.pid}"):
            mgr = CheckpointManager(tmp_path, async_mode="off")
        assert mgr.latest_step() == 1
        mgr.close()
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- lineage


def test_new_run_in_a_folder_with_checkpoints_deletes_none_of_them(tmp_path):
    save_steps(tmp_path, [10, 20, 30], keep_last=2)  # an earlier run: keeps 20 and 30
    old = {s: dir_of(tmp_path, s).name for s in (20, 30)}
    save_steps(tmp_path, [1, 2, 3], keep_last=2)  # a new run that did not resume
    assert step_dirs(tmp_path) == sorted(
        [*old.values(), *(dir_of(tmp_path, s).name for s in (2, 3))]
    )
    mgr = CheckpointManager(tmp_path, read_only=True)
    for s in (2, 3, 20, 30):
        assert load_into(mgr, s)[0] == s
    # Resuming from the newest checkpoint continues its run: retention goes on with it.
    with CheckpointManager(tmp_path, async_mode="off", keep_last=2) as resumed:
        assert load_into(resumed)[0] == 30
        resumed.save(40, state_of(40))
    assert sorted(int(n[5:17]) for n in step_dirs(tmp_path)) == [2, 3, 30, 40]


def test_flipped_manifest_byte_is_reported_and_never_deleted(tmp_path):
    save_steps(tmp_path, [1, 2, 3], keep_last=3)
    damaged = dir_of(tmp_path, 3)
    manifest = damaged / "manifest.json"
    flip_byte(manifest, manifest.read_bytes().index(b'"time":') + 8)  # still valid JSON
    kept = tree_bytes(damaged)
    mgr = CheckpointManager(tmp_path, async_mode="off", keep_last=1)
    with pytest.warns(CheckpointWarning, match=rf"{damaged.name} is damaged.*checksum mismatch"):
        assert mgr.latest_step() == 2
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json.*fallback=True"):
        load_into(mgr)
    with pytest.warns(
        CheckpointWarning, match=rf"loaded step 2 .* instead of step 3.*{damaged.name}"
    ):
        assert load_into(mgr, fallback=True)[0] == 2
    for s in (4, 5):  # keep_last=1 runs after every save: the damaged folder stays
        mgr.save(s, state_of(s))
    mgr.close()
    assert tree_bytes(damaged) == kept
    assert sorted(int(n[5:17]) for n in step_dirs(tmp_path)) == [1, 2, 3, 5]
    # Loading the newest intact checkpoint by its step (as latest_step() names it) while a
    # newer one is damaged: a new lineage, so the intact ones before the damage are kept too.
    with CheckpointManager(tmp_path, async_mode="off", keep_last=1) as again:
        with pytest.warns(CheckpointWarning):
            load_into(again, step=2)
        again.save(6, state_of(6))
        again.save(7, state_of(7))
    assert sorted(int(n[5:17]) for n in step_dirs(tmp_path)) == [1, 2, 3, 5, 7]


# -------------------------------------------------------------------------- chaos, library


@pytest.mark.parametrize("what", ["manifest", "data", "marker"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_and_nothing_is_deleted(
    tmp_path, what
):
    save_steps(tmp_path, [1, 2, 3], keep_last=2)
    latest = dir_of(tmp_path, 3)
    target = {
        "manifest": "manifest.json",
        "data": "m-00000.safetensors",
        "marker": "done-00000.json",
    }
    flip_byte(latest / target[what], -3)
    before = tree_bytes(tmp_path)
    mgr = CheckpointManager(tmp_path, async_mode="thread", keep_last=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_into(mgr, fallback=True)[0] == 2
    said = messages(caught)
    assert "loaded step 2" in said and target[what] in said, said
    assert tree_bytes(tmp_path) == before  # nothing deleted or changed
    for s in (4, 5, 6):  # the run goes on after the fallback
        mgr.save(s, state_of(s))
    mgr.close()
    # Nothing of the run it fell back from is deleted (the damaged one least of all).
    assert {k: v for k, v in tree_bytes(tmp_path).items() if k in before} == before
    assert sorted(int(n[5:17]) for n in step_dirs(tmp_path)) == [2, 3, 5, 6]
    assert load_into(CheckpointManager(tmp_path, read_only=True))[0] == 6


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path):
    save_steps(tmp_path, [1, 2])
    for s in (1, 2):
        flip_byte(dir_of(tmp_path, s) / "m-00000.safetensors", -3)
    with pytest.raises(
        CheckpointNotFoundError, match=r"no intact checkpoint.*every one is damaged"
    ):
        load_into(CheckpointManager(tmp_path, read_only=True), fallback=True)


@pytest.mark.parametrize(
    ("mode", "where"), [("thread", "m-00000"), ("off", "manifest"), ("process", "done-")]
)
def test_disk_full_fails_clearly_and_loses_no_checkpoint(tmp_path, mode, where):
    storage = FaultyStorage(tmp_path / "ck", tmp_path / "fault.json")
    mgr = CheckpointManager(None, storage=storage, async_mode=mode, keep_last=2)
    for s in (1, 2):
        mgr.save(s, state_of(s))
    mgr.wait()  # the writes and the retention after them
    before = tree_bytes(tmp_path / "ck")
    storage.set_fault("enospc", match=where, budget=100)
    if mode == "off":
        with pytest.raises(CheckpointWriteError) as info:
            mgr.save(3, state_of(3))
    else:
        handle = mgr.save(3, state_of(3))
        with pytest.raises(CheckpointWriteError) as info:
            handle.wait()
    text = str(info.value)
    assert os.strerror(28) in text and where in text and "earlier checkpoints are untouched" in text
    assert mgr.latest_step() == 2
    after = tree_bytes(tmp_path / "ck")
    assert {k: v for k, v in after.items() if k in before} == before  # none lost
    assert not [k for k in after if ".tmp-" in k]  # no half-written file left behind
    storage.set_fault(None)  # space freed: the run goes on
    mgr.save(4, state_of(4)).wait()
    mgr.close()
    assert sorted(int(n[5:17]) for n in step_dirs(tmp_path / "ck")) == [2, 4]  # failed 3 cleaned
    assert load_into(CheckpointManager(None, storage=storage, read_only=True))[0] == 4


def test_read_only_folder_is_a_clear_error_and_loses_no_checkpoint(tmp_path):
    storage = FaultyStorage(tmp_path / "ck", tmp_path / "fault.json")
    mgr = CheckpointManager(None, storage=storage, async_mode="thread", keep_last=1)
    for s in (1, 2):
        mgr.save(s, state_of(s))
    mgr.wait()  # the writes and the retention after them
    before = tree_bytes(tmp_path / "ck")
    storage.set_fault("erofs", match="step-")  # the folder turns read-only mid-run
    with pytest.raises(CheckpointWriteError, match=r"Read-only file system.*untouched"):
        mgr.save(3, state_of(3)).wait()
    assert tree_bytes(tmp_path / "ck") == before and mgr.latest_step() == 2
    mgr.close()
    storage.set_fault("erofs", match="")  # read-only from the start
    with pytest.raises(CheckpointError, match=r"cannot create the lock file.*read_only=True"):
        CheckpointManager(None, storage=storage, async_mode="off")
    reader = CheckpointManager(None, storage=storage, policy=CheckpointPolicy(read_only=True))
    assert load_into(reader)[0] == 2
    assert tree_bytes(tmp_path / "ck") == before
