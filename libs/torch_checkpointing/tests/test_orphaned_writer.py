"""A writer process whose trainer is killed mid-save exits by itself, silently, committing
nothing more; the previous checkpoint stays intact."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing._writer import ORPHANED_EXIT

TESTS = Path(__file__).resolve().parent

TRAINER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    sys.path.insert(0, sys.argv[3])
    from _faulty_storage import StallUntilOrphanedStorage
    from torch_checkpointing import CheckpointManager

    storage = StallUntilOrphanedStorage(
        sys.argv[1], match="step-000000000002", started=sys.argv[2], owner_pid=os.getpid()
    )
    mgr = CheckpointManager(None, storage=storage, async_mode="process")
    mgr.save(1, {"model": {"w": torch.full((4096,), 1.0)}}).wait()
    mgr.save(2, {"model": {"w": torch.full((4096,), 2.0)}})  # stalls until we are killed
    time.sleep(600)
    """
)

# Runs the trainer as a child subreaper (Linux), so the orphaned writer is re-parented to it
# and its exit status can be read; the writer's stderr is the trainer's (a file).
HARNESS = textwrap.dedent(
    """
    import ctypes, json, os, signal, subprocess, sys, time
    root, started, tests, err_path, trainer_code = sys.argv[1:6]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    with open(err_path, "w") as err:
        trainer = subprocess.Popen(
            [sys.executable, "-c", trainer_code, root, started, tests],
            stdout=subprocess.DEVNULL, stderr=err,
        )
    deadline = time.monotonic() + 120
    while not os.path.exists(started):
        if trainer.poll() is not None or time.monotonic() > deadline:
            print(json.dumps({"error": f"trainer exited early: {trainer.returncode}"}))
            sys.exit(1)
        time.sleep(0.01)
    writer = int(open(started).read())
    trainer.kill()  # SIGKILL, mid-save: its writer is now an orphan, re-parented to us
    trainer.wait()
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline:
        pid, raw = os.waitpid(writer, os.WNOHANG)
        if pid:
            status = os.waitstatus_to_exitcode(raw)
            break
        time.sleep(0.01)
    if status is None:
        os.kill(writer, signal.SIGKILL)
        os.waitpid(writer, 0)
    print(json.dumps({"trainer": trainer.returncode, "writer": status}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs PR_SET_CHILD_SUBREAPER")
def test_writer_orphaned_mid_save_exits_silently_and_keeps_the_previous_checkpoint(tmp_path):
    # Guards the reported bug: the orphan finished the save, then printed a BrokenPipeError
    # traceback replying to its dead parent (exit status 1) and committed step 2 behind it.
    root, started, err = tmp_path / "ckpt", tmp_path / "started", tmp_path / "stderr.txt"
    out = subprocess.run(
        [sys.executable, "-c", HARNESS, str(root), str(started), str(TESTS), str(err), TRAINER],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    stderr = err.read_text()
    assert result == {"trainer": -9, "writer": ORPHANED_EXIT}, (result, stderr)
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    mgr = CheckpointManager(root, read_only=True)
    assert mgr.steps() == [1]  # the abandoned step 2 never completes
    assert len(list(root.glob("step-000000000002.*"))) == 1
    got = {"model": {"w": torch.zeros(4096)}}
    assert mgr.load(got) == 1 and torch.equal(got["model"]["w"], torch.full((4096,), 1.0))
